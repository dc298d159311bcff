package image

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strings"
)

const (
	// WorkloadRef is the reference of the inference workload image that BuildWorkload writes.
	WorkloadRef = "localhost/berth/infer:test"
	// WorkloadPackage is the Go package of the inference workload binary.
	WorkloadPackage = "github.com/berth-dev/berth/test/workload/cmd/infer"
	// WorkloadBinary is the image path of the workload binary, the image's entrypoint.
	WorkloadBinary = "/usr/local/bin/infer"

	// RedisRef is the reference of the Redis image that BuildRedis writes.
	RedisRef = "localhost/berth/redis:test"
	// RedisServer and RedisCLI are the host paths of the Debian redis-server and redis-tools
	// binaries, copied to the same image paths by BuildRedis.
	RedisServer = "/usr/bin/redis-server"
	RedisCLI    = "/usr/bin/redis-cli" // see RedisServer
	// RedisAddr is the address Redis listens on inside its container's network namespace.
	RedisAddr = "127.0.0.1:6379"

	// PauseRef is the reference of the CRI sandbox ("pause") image that BuildPause writes.
	PauseRef = "localhost/berth/pause:3.10"
	// PauseBinary is the image path of the pause program, the image's entrypoint.
	PauseBinary = "/pause"

	// StampSuffix is appended to a builder's output path to name the file that records what
	// the archive there holds (see BuildGoImage).
	StampSuffix = ".stamp"

	// stampVersion changes whenever the archive format written for the same manifest changes.
	stampVersion = 1
)

// RedisEntrypoint is the entrypoint of the image BuildRedis writes: redis-server in the
// foreground, logging to stdout, listening on RedisAddr only, with protected mode off and no
// persistence (no RDB snapshots, no AOF). Arguments given as the container's command (CRI
// args) are appended, for example "--maxmemory", "64mb".
var RedisEntrypoint = []string{
	RedisServer,
	"--bind", "127.0.0.1",
	"--port", "6379",
	"--protected-mode", "no",
	"--save", "",
	"--appendonly", "no",
	"--daemonize", "no",
	"--dir", "/data",
}

// stamp is the JSON content of the file beside a builder's output.
type stamp struct {
	Version  int    `json:"version"`
	Ref      string `json:"ref"`
	Manifest string `json:"manifest"`
	Size     int64  `json:"size"`
}

// writeCached writes the image archive of rootfs and cfg named ref to out unless out already
// holds it, as recorded by the stamp beside out (same ref, manifest digest and size).
func writeCached(out, ref, rootfs string, cfg Config) error {
	if _, err := ParseRef(ref); err != nil {
		return err
	}
	md, err := ManifestDigest(rootfs, cfg)
	if err != nil {
		return err
	}
	want := stamp{Version: stampVersion, Ref: ref, Manifest: md}
	if b, err := os.ReadFile(out + StampSuffix); err == nil {
		var got stamp
		if fi, err := os.Stat(out); err == nil && json.Unmarshal(b, &got) == nil {
			want.Size = fi.Size()
			if got == want {
				return nil
			}
		}
	}
	got, err := WriteArchiveFile(out, ref, rootfs, cfg)
	if err != nil {
		return err
	}
	if got != md {
		return fmt.Errorf("image archive %s: %s changed while it was archived (%s, then %s)", out, rootfs, md, got)
	}
	fi, err := os.Stat(out)
	if err != nil {
		return fmt.Errorf("image archive %s: %w", out, err)
	}
	want.Size = fi.Size()
	b, err := json.Marshal(want)
	if err != nil {
		return fmt.Errorf("stamp for %s: %w", out, err)
	}
	f, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+StampSuffix+".tmp-*")
	if err != nil {
		return fmt.Errorf("stamp for %s: %w", out, err)
	}
	_, err = f.Write(append(b, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(f.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(f.Name(), out+StampSuffix)
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("stamp for %s: %w", out, err)
	}
	return nil
}

// run runs cmd, returning an error that includes its combined output.
func run(cmd *exec.Cmd) error {
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w\n%s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(buf.String()))
	}
	return nil
}

// withTempRootfs calls fn with a new Rootfs in a temporary directory, removed afterwards.
func withTempRootfs(fn func(r *Rootfs, tmp string) error) error {
	tmp, err := os.MkdirTemp("", "berth-image-")
	if err != nil {
		return fmt.Errorf("temporary rootfs: %w", err)
	}
	defer os.RemoveAll(tmp)
	r, err := NewRootfs(filepath.Join(tmp, "rootfs"))
	if err != nil {
		return err
	}
	return fn(r, tmp)
}

// binaryName returns the name of the binary `go build` makes of pkg, relative to repoRoot.
func binaryName(repoRoot, pkg string) (string, error) {
	p := pkg
	if p == "." || p == ".." || strings.HasPrefix(p, "./") || strings.HasPrefix(p, "../") {
		abs, err := filepath.Abs(filepath.Join(repoRoot, p))
		if err != nil {
			return "", fmt.Errorf("package %s: %w", pkg, err)
		}
		p = abs
	}
	name := path.Base(filepath.ToSlash(filepath.Clean(p)))
	if name == "." || name == ".." || name == "/" || strings.Contains(name, "...") {
		return "", fmt.Errorf("package %q: cannot name a binary after it", pkg)
	}
	return name, nil
}

// BuildGoImage builds the Go main package pkg (an import path, or a directory relative to
// repoRoot such as "./cmd/x") with `go build -trimpath -buildvcs=false -ldflags=-s -w`,
// CGO_ENABLED=0, GOOS=linux and GOARCH=runtime.GOARCH, run in the module directory repoRoot
// with the go command found in PATH, and writes to out an image archive (see WriteArchive)
// named ref holding a NewRootfs base, a static busybox (AddBusybox with DefaultBusybox) and the
// binary at /usr/local/bin/<last element of pkg> (AddDynamicBinary: with its dynamic loader and
// shared libraries when it is dynamically linked, as a binary using purego is even without cgo). cfg is the image config; when it has neither
// Entrypoint nor Cmd, the entrypoint is the binary.
//
// Builders are cached: beside out, out+StampSuffix records the reference, manifest digest and
// size of the archive last written there. The binary is always rebuilt (go's build cache makes
// that cheap) and the root filesystem assembled, but out is rewritten only when the stamp does
// not match (inputs changed, out missing or replaced). out's parent directories are created;
// out is replaced atomically, so concurrent builders of the same out are safe.
//
// It returns ref. Errors name the package, the tool and its output, or the path involved.
func BuildGoImage(ctx context.Context, repoRoot, pkg, ref, out string, cfg Config) (string, error) {
	return BuildGoImageWith(ctx, repoRoot, pkg, ref, out, cfg)
}

// Binary is a program of this machine that BuildGoImageWith adds to an image: Src, its path
// here, goes to Dst, an absolute path inside the image, with its dynamic loader and shared
// libraries (AddDynamicBinary).
type Binary struct {
	Src, Dst string
}

// BuildGoImageWith is BuildGoImage with the binaries bins added to the image after the Go
// binary (AddDynamicBinary each: their loader and shared libraries at the paths they have on
// this machine). The cache stamp covers them, as it covers every file of the root filesystem.
// Errors are BuildGoImage's, and name a binary or library that could not be read.
func BuildGoImageWith(ctx context.Context, repoRoot, pkg, ref, out string, cfg Config, bins ...Binary) (string, error) {
	if _, err := ParseRef(ref); err != nil {
		return "", err
	}
	name, err := binaryName(repoRoot, pkg)
	if err != nil {
		return "", err
	}
	err = withTempRootfs(func(r *Rootfs, tmp string) error {
		bin := filepath.Join(tmp, name)
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", bin, pkg)
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
		if err := run(cmd); err != nil {
			return fmt.Errorf("build %s in %s: %w", pkg, repoRoot, err)
		}
		if err := r.AddBusybox(""); err != nil {
			return err
		}
		dst := "/usr/local/bin/" + name
		// a binary that loads libraries at run time (purego: berthctl's NVML) is dynamically
		// linked even without cgo: its loader and libraries come along
		if _, err := r.AddDynamicBinary(bin, dst); err != nil {
			return err
		}
		for _, b := range bins {
			if _, err := r.AddDynamicBinary(b.Src, b.Dst); err != nil {
				return fmt.Errorf("image %s: %w", ref, err)
			}
		}
		if cfg.Entrypoint == nil && cfg.Cmd == nil {
			cfg.Entrypoint = []string{dst}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		return writeCached(out, ref, r.Dir, cfg)
	})
	if err != nil {
		return "", err
	}
	return ref, nil
}

// BuildWorkload builds the inference workload, WorkloadPackage in the berth module at
// repoRoot, into the image WorkloadRef written to out, with the binary at WorkloadBinary as
// its entrypoint and busybox for debugging (see BuildGoImage, also for caching and errors).
// It returns WorkloadRef.
func BuildWorkload(ctx context.Context, repoRoot, out string) (string, error) {
	return BuildGoImage(ctx, repoRoot, WorkloadPackage, WorkloadRef, out, Config{})
}

// BuildRedis writes to out the image RedisRef: redis-server (RedisServer, from Debian's
// redis-server package) and, when installed, redis-cli (RedisCLI, from redis-tools), each with
// the shared libraries and loader it needs (AddDynamicBinary), a static busybox (AddBusybox with
// DefaultBusybox, for sh), an empty /data, and RedisEntrypoint as entrypoint. Caching is as for
// BuildGoImage. It returns RedisRef. Errors name the missing or unreadable file or out.
func BuildRedis(ctx context.Context, out string) (string, error) {
	err := withTempRootfs(func(r *Rootfs, _ string) error {
		if err := r.AddBusybox(""); err != nil {
			return err
		}
		if _, err := r.AddDynamicBinary(RedisServer, RedisServer); err != nil {
			return fmt.Errorf("redis image: %w", err)
		}
		if _, err := os.Stat(RedisCLI); err == nil {
			if _, err := r.AddDynamicBinary(RedisCLI, RedisCLI); err != nil {
				return fmt.Errorf("redis image: %w", err)
			}
		} else if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("redis image: %w", err)
		}
		if err := r.Mkdir("/data", 0o755); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		return writeCached(out, RedisRef, r.Dir, Config{Entrypoint: RedisEntrypoint, WorkingDir: "/data"})
	})
	if err != nil {
		return "", err
	}
	return RedisRef, nil
}

// pauseSource is the C source of the pause program: it waits, reaping any children (it may be
// PID 1 of a shared PID namespace), until SIGTERM or SIGINT, and then exits 0.
const pauseSource = `/* pause: berth's CRI sandbox process. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
	int saved = errno;
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	errno = saved;
}

int main(int argc, char **argv) {
	struct sigaction sa;
	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("berth-pause");
		return 0;
	}
	memset(&sa, 0, sizeof sa);
	sigemptyset(&sa.sa_mask);
	sa.sa_handler = on_term;
	if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0)
		return 1;
	sa.sa_handler = on_chld;
	sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
	if (sigaction(SIGCHLD, &sa, NULL) < 0)
		return 1;
	for (;;)
		pause();
}
`

// buildPauseBinary compiles pauseSource into the static executable dst with $CC (default
// "gcc"), using dir for the source.
func buildPauseBinary(ctx context.Context, dir, dst string) error {
	src := filepath.Join(dir, "pause.c")
	if err := os.WriteFile(src, []byte(pauseSource), 0o644); err != nil {
		return fmt.Errorf("pause source: %w", err)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if err := run(exec.CommandContext(ctx, cc, "-O2", "-static", "-s", "-o", dst, src)); err != nil {
		return fmt.Errorf("build pause: %w", err)
	}
	return nil
}

// BuildPause writes to out the image PauseRef for CRI sandboxes: only PauseBinary, a static C
// program (built with $CC, default gcc, with -static) that reaps children and exits 0 on
// SIGTERM or SIGINT, as entrypoint. Caching is as for BuildGoImage. It returns PauseRef.
// Errors include the compiler's output or name out.
func BuildPause(ctx context.Context, out string) (string, error) {
	tmp, err := os.MkdirTemp("", "berth-pause-")
	if err != nil {
		return "", fmt.Errorf("pause image: %w", err)
	}
	defer os.RemoveAll(tmp)
	root := filepath.Join(tmp, "rootfs")
	if err := os.Mkdir(root, 0o755); err != nil {
		return "", fmt.Errorf("pause image: %w", err)
	}
	if err := buildPauseBinary(ctx, tmp, filepath.Join(root, strings.TrimPrefix(PauseBinary, "/"))); err != nil {
		return "", err
	}
	if err := writeCached(out, PauseRef, root, Config{Entrypoint: []string{PauseBinary}}); err != nil {
		return "", err
	}
	return PauseRef, nil
}
