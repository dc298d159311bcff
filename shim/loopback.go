package shim

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// loopbackUp sets the loopback device up in the network namespace of pid (/proc/PID/ns/net).
// runc restores a container that owns its network namespace into a new one where CRIU leaves
// "lo" down (checkpoint-restore/criu#590), so a server bound to 127.0.0.1 would be unreachable.
// It returns an error naming the pid and the step.
func loopbackUp(pid int) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // not unlocked if the thread cannot return to its netns: it is discarded
		errc <- func() error {
			self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(self)
			target, err := unix.Open(fmt.Sprintf("/proc/%d/ns/net", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(target)
			if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
				return fmt.Errorf("join netns: %w", err)
			}
			err = setUp("lo")
			if unix.Setns(self, unix.CLONE_NEWNET) == nil {
				runtime.UnlockOSThread()
			}
			return err
		}()
	}()
	if err := <-errc; err != nil {
		return fmt.Errorf("set lo up in the network namespace of pid %d: %w", pid, err)
	}
	return nil
}

func setUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get flags: %w", err)
	}
	if ifr.Uint16()&unix.IFF_UP != 0 {
		return nil
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set flags: %w", err)
	}
	return nil
}
