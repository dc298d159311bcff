package image

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
)

// DefaultBusybox is the static busybox that AddBusybox copies when given "": the one Debian's
// busybox-static package installs (test/stack/install.sh installs that package).
const DefaultBusybox = "/bin/busybox"

// Rootfs is a directory on this machine being assembled into an image's root filesystem.
//
// Paths called "image paths" below are absolute paths as seen inside the image (for example
// "/usr/bin/redis-server"); relative ones are taken from "/". They are resolved under Dir the
// way the kernel would inside the image: symbolic links already in Dir are followed, with
// absolute targets and ".." kept within Dir, so nothing is ever written outside Dir. The last
// component of a destination is not followed: an existing file or symlink there is replaced.
type Rootfs struct {
	// Dir is the host directory that holds the root filesystem.
	Dir string
}

// baseDirs are the directories NewRootfs creates, with their modes.
var baseDirs = []struct {
	path string
	mode fs.FileMode
}{
	{"bin", 0o755}, {"sbin", 0o755}, {"usr/bin", 0o755}, {"usr/sbin", 0o755},
	{"usr/local/bin", 0o755}, {"tmp", fs.ModeSticky | 0o777}, {"proc", 0o555}, {"sys", 0o555},
	{"dev", 0o755}, {"etc", 0o755}, {"root", 0o700}, {"var", 0o755}, {"var/tmp", fs.ModeSticky | 0o777},
	{"run", 0o755},
}

// baseFiles are the /etc files NewRootfs writes.
var baseFiles = []struct {
	path, data string
}{
	{"etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"},
	{"etc/group", "root:x:0:\nnogroup:x:65534:\n"},
	{"etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"},
	{"etc/nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n"},
}

// NewRootfs creates (or completes) a root filesystem in the host directory dir: dir itself
// (mode 0755), the directories bin, sbin, usr/bin, usr/sbin, usr/local/bin, tmp and var/tmp
// (1777), proc, sys, dev, etc, root (0700), var and run, and minimal /etc/passwd, /etc/group
// (root and nobody), /etc/hosts (localhost) and /etc/nsswitch.conf (files, then dns for hosts).
// Existing files are overwritten; other contents of dir are kept. Errors name the path.
func NewRootfs(dir string) (*Rootfs, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create rootfs %s: %w", dir, err)
	}
	r := &Rootfs{Dir: dir}
	for _, d := range baseDirs {
		if err := r.Mkdir(d.path, d.mode); err != nil {
			return nil, err
		}
	}
	for _, f := range baseFiles {
		if err := r.WriteFile(f.path, []byte(f.data), 0o644); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// resolve returns the host path of the image path p. Symbolic links in Dir are followed within
// Dir for every component but the last, which is followed too when followLast is set. A
// component that does not exist ends the resolution: the rest is appended unresolved.
func (r *Rootfs) resolve(p string, followLast bool) (string, error) {
	rest := strings.Split(strings.TrimPrefix(path.Clean("/"+p), "/"), "/")
	cur := "/" // resolved image path so far
	for hops := 0; len(rest) > 0; {
		comp := rest[0]
		rest = rest[1:]
		if comp == "" {
			continue
		}
		next := path.Join(cur, comp)
		if len(rest) == 0 && !followLast {
			cur = next
			break
		}
		fi, err := os.Lstat(filepath.Join(r.Dir, filepath.FromSlash(next)))
		if errors.Is(err, fs.ErrNotExist) {
			cur = path.Join(append([]string{next}, rest...)...)
			break
		}
		if err != nil {
			return "", fmt.Errorf("resolve %s in rootfs %s: %w", p, r.Dir, err)
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			cur = next
			continue
		}
		if hops++; hops > 40 {
			return "", fmt.Errorf("resolve %s in rootfs %s: too many levels of symbolic links", p, r.Dir)
		}
		target, err := os.Readlink(filepath.Join(r.Dir, filepath.FromSlash(next)))
		if err != nil {
			return "", fmt.Errorf("resolve %s in rootfs %s: %w", p, r.Dir, err)
		}
		if !path.IsAbs(target) {
			target = path.Join(cur, target)
		}
		// path.Clean of an absolute path never climbs above "/", which keeps it within Dir.
		rest = append(strings.Split(strings.TrimPrefix(path.Clean("/"+target), "/"), "/"), rest...)
		cur = "/"
	}
	return filepath.Join(r.Dir, filepath.FromSlash(cur)), nil
}

// Path returns the host path under Dir of the image path p, with every symbolic link in it
// followed within Dir (the file need not exist). Errors name p and Dir.
func (r *Rootfs) Path(p string) (string, error) {
	return r.resolve(p, true)
}

// Mkdir creates the directory at image path p and any missing parents (0755), and sets p's
// mode to mode (permission bits plus fs.ModeSticky/ModeSetuid/ModeSetgid). An existing
// directory is kept and its mode set. Errors name the host path.
func (r *Rootfs) Mkdir(p string, mode fs.FileMode) error {
	hp, err := r.resolve(p, true)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(hp, 0o755); err != nil {
		return fmt.Errorf("create directory %s: %w", hp, err)
	}
	if err := os.Chmod(hp, mode); err != nil {
		return fmt.Errorf("create directory %s: %w", hp, err)
	}
	return nil
}

// prepare returns the host path for a new file at image path dst: its parent exists (created
// 0755 if needed) and any non-directory already at dst is removed.
func (r *Rootfs) prepare(dst string) (string, error) {
	hp, err := r.resolve(dst, false)
	if err != nil {
		return "", err
	}
	if hp == filepath.Clean(r.Dir) {
		return "", fmt.Errorf("rootfs %s: %q names the root directory, not a file", r.Dir, dst)
	}
	if err := os.MkdirAll(filepath.Dir(hp), 0o755); err != nil {
		return "", fmt.Errorf("create directory %s: %w", filepath.Dir(hp), err)
	}
	fi, err := os.Lstat(hp)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return "", fmt.Errorf("replace %s: %w", hp, err)
	case fi.IsDir():
		return "", fmt.Errorf("replace %s: is a directory", hp)
	default:
		if err := os.Remove(hp); err != nil {
			return "", fmt.Errorf("replace %s: %w", hp, err)
		}
	}
	return hp, nil
}

// WriteFile writes data to a new file at image path dst with mode (permission bits plus
// setuid/setgid/sticky), creating parent directories (0755) and replacing what was at dst
// unless it is a directory. Errors name the host path.
func (r *Rootfs) WriteFile(dst string, data []byte, mode fs.FileMode) error {
	hp, err := r.prepare(dst)
	if err != nil {
		return err
	}
	if err := os.WriteFile(hp, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", hp, err)
	}
	if err := os.Chmod(hp, mode); err != nil {
		return fmt.Errorf("write %s: %w", hp, err)
	}
	return nil
}

// AddFile copies the contents of the host file src (symbolic links followed) to image path dst,
// creating parent directories (0755) and replacing what was at dst unless it is a directory.
// The copy gets mode, or src's permission bits (with setuid/setgid/sticky) when mode is 0.
// Errors name src or the host destination path.
func (r *Rootfs) AddFile(src, dst string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("add file: %w", err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return fmt.Errorf("add file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("add file %s: not a regular file", src)
	}
	if mode == 0 {
		mode = fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	}
	hp, err := r.prepare(dst)
	if err != nil {
		return err
	}
	out, err := os.OpenFile(hp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("add file %s: %w", src, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s to %s: %w", src, hp, err)
	}
	if err := out.Chmod(mode); err != nil {
		out.Close()
		return fmt.Errorf("copy %s to %s: %w", src, hp, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("copy %s to %s: %w", src, hp, err)
	}
	return nil
}

// AddSymlink creates a symbolic link at image path dst pointing to target, which is stored
// verbatim (an absolute target is interpreted inside the image), creating parent directories
// (0755) and replacing what was at dst unless it is a directory. Errors name the host path.
func (r *Rootfs) AddSymlink(dst, target string) error {
	hp, err := r.prepare(dst)
	if err != nil {
		return err
	}
	if err := os.Symlink(target, hp); err != nil {
		return fmt.Errorf("add symlink: %w", err)
	}
	return nil
}

// exists reports whether something (any file type, symlinks not followed) is at image path p.
func (r *Rootfs) exists(p string) (bool, error) {
	hp, err := r.resolve(p, false)
	if err != nil {
		return false, err
	}
	_, err = os.Lstat(hp)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("rootfs %s: %w", r.Dir, err)
	}
	return true, nil
}

// AddBusybox copies the busybox binary busyboxPath (DefaultBusybox when "") to /bin/busybox,
// with its shared libraries if it is dynamically linked (see AddDynamicBinary), and creates a
// symbolic link to /bin/busybox for every applet it reports, at the path `busybox --list-full`
// gives (for example /bin/sh, /usr/bin/env, /sbin/ifconfig), or in /bin when that option is
// not supported (`busybox --list`). Paths that already exist are left alone. busyboxPath must
// be runnable on this machine to list its applets. Errors name busyboxPath or the host path.
func (r *Rootfs) AddBusybox(busyboxPath string) error {
	if busyboxPath == "" {
		busyboxPath = DefaultBusybox
	}
	applets, err := listApplets(busyboxPath)
	if err != nil {
		return err
	}
	if _, err := r.AddDynamicBinary(busyboxPath, "/bin/busybox"); err != nil {
		return err
	}
	for _, a := range applets {
		if a == "/bin/busybox" {
			continue
		}
		ok, err := r.exists(a)
		if err != nil {
			return err
		}
		if ok {
			continue
		}
		if err := r.AddSymlink(a, "/bin/busybox"); err != nil {
			return err
		}
	}
	return nil
}

// listApplets returns the image paths of busybox's applets.
func listApplets(busybox string) ([]string, error) {
	out, err := exec.Command(busybox, "--list-full").Output()
	full := err == nil
	if !full {
		if out, err = exec.Command(busybox, "--list").Output(); err != nil {
			return nil, fmt.Errorf("list applets of %s: %w", busybox, err)
		}
	}
	var applets []string
	for _, l := range strings.Fields(string(out)) {
		if strings.Contains(l, "..") || (!full && strings.Contains(l, "/")) {
			return nil, fmt.Errorf("list applets of %s: unexpected applet %q", busybox, l)
		}
		if !full {
			l = "bin/" + l
		}
		applets = append(applets, "/"+strings.TrimPrefix(l, "/"))
	}
	if len(applets) == 0 {
		return nil, fmt.Errorf("list applets of %s: none listed", busybox)
	}
	return applets, nil
}
