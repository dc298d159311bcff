package shim

import (
	"fmt"
	"os"
	"runtime"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// The hostname of a restored container that joins its pod's UTS namespace.
//
// A CRI container joins the UTS namespace of its pod's sandbox (the spec names it by path), and
// runc restores it into that namespace with CRIU's join-ns. CRIU then still restores the UTS
// namespace's contents from its image (it writes the dumped hostname and domain name whenever the
// image carries a UTS namespace, joined or not), so the new pod's kernel hostname, for its pause
// container and every sidecar, would become the old pod's. The shim reads the joined namespace's
// names in Create, before anything ran, and writes them back right after runc's restore returns
// (Start). In between, for the restore's duration and while runc finishes (CRIU writes the names
// before it restores memory), the pod's namespace shows the old pod's hostname: a sidecar that
// calls gethostname(2) exactly then, or the restored processes in the moment after CRIU resumed
// them and before Start sets it back, read the old name. runc offers no way to keep CRIU from
// writing them (its external namespaces are network and PID only).

// utsNames is a joined UTS namespace and its names as they were before the restore.
type utsNames struct {
	path             string
	hostname, domain string
}

// joinedUTS returns the path of the UTS namespace spec joins, or "" when the container gets a
// UTS namespace of its own (or the host's).
func joinedUTS(spec *specs.Spec) string {
	if spec.Linux == nil {
		return ""
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Type == specs.UTSNamespace {
			return ns.Path
		}
	}
	return ""
}

// readUTS reads the host and domain names of the UTS namespace at path.
func readUTS(path string) (*utsNames, error) {
	n := &utsNames{path: path}
	err := inUTS(path, func() error {
		var u unix.Utsname
		if err := unix.Uname(&u); err != nil {
			return err
		}
		n.hostname, n.domain = unix.ByteSliceToString(u.Nodename[:]), unix.ByteSliceToString(u.Domainname[:])
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the names of UTS namespace %s: %w", path, err)
	}
	return n, nil
}

// restore writes n's names back into its namespace; it reports whether the hostname had changed.
func (n *utsNames) restore() (was string, err error) {
	err = inUTS(n.path, func() error {
		var u unix.Utsname
		if err := unix.Uname(&u); err != nil {
			return err
		}
		was = unix.ByteSliceToString(u.Nodename[:])
		if was != n.hostname {
			if err := unix.Sethostname([]byte(n.hostname)); err != nil {
				return err
			}
		}
		if unix.ByteSliceToString(u.Domainname[:]) != n.domain {
			return unix.Setdomainname([]byte(n.domain))
		}
		return nil
	})
	if err != nil {
		return was, fmt.Errorf("set the names of UTS namespace %s back: %w", n.path, err)
	}
	return was, nil
}

// inUTS runs fn on a locked OS thread that has joined the UTS namespace at path. The thread
// returns to its own namespace afterwards; if it cannot, it stays locked and exits with the
// goroutine, so no other goroutine runs in the wrong namespace.
func inUTS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		own, err := os.Open("/proc/thread-self/ns/uts")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer own.Close()
		target, err := os.Open(path)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWUTS); err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		ferr := fn()
		if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWUTS); err != nil {
			errc <- ferr // the thread stays locked and ends with this goroutine
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
