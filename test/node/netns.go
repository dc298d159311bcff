package node

import (
	"context"
	"fmt"
	"net"
	"runtime"

	"golang.org/x/sys/unix"
)

// NetnsDialer returns a DialContext that opens connections inside the network namespace of
// process pid (/proc/PID/ns/net): how a test reaches a server listening on 127.0.0.1 inside a
// container that has its own network namespace. The socket is created on a locked OS thread that
// has joined the namespace and then returns to its own; the connection stays in the container's.
func NetnsDialer(pid int) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		type result struct {
			c   net.Conn
			err error
		}
		ch := make(chan result, 1)
		go func() {
			runtime.LockOSThread()
			// The thread is not unlocked on failure to restore: the runtime then discards it.
			orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				ch <- result{err: fmt.Errorf("open own netns: %w", err)}
				return
			}
			defer unix.Close(orig)
			target, err := unix.Open(fmt.Sprintf("/proc/%d/ns/net", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				ch <- result{err: fmt.Errorf("open netns of pid %d: %w", pid, err)}
				runtime.UnlockOSThread()
				return
			}
			defer unix.Close(target)
			if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
				ch <- result{err: fmt.Errorf("join netns of pid %d: %w", pid, err)}
				runtime.UnlockOSThread()
				return
			}
			var d net.Dialer
			c, err := d.DialContext(ctx, network, addr)
			if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
				runtime.UnlockOSThread()
			}
			ch <- result{c, err}
		}()
		r := <-ch
		return r.c, r.err
	}
}
