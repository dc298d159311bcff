package image

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// elfObject is what AddDynamicBinary needs from one ELF file.
type elfObject struct {
	class   elf.Class
	machine elf.Machine
	interp  string   // PT_INTERP, "" for a static binary or a library
	needed  []string // DT_NEEDED
	rpath   []string // DT_RPATH, used only without DT_RUNPATH
	runpath []string // DT_RUNPATH
}

// readELF parses the ELF file at the host path p.
func readELF(p string) (*elfObject, error) {
	f, err := elf.Open(p)
	if err != nil {
		return nil, fmt.Errorf("read ELF %s: %w", p, err)
	}
	defer f.Close()
	o := &elfObject{class: f.Class, machine: f.Machine}
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		b, err := io.ReadAll(prog.Open())
		if err != nil {
			return nil, fmt.Errorf("read ELF %s: PT_INTERP: %w", p, err)
		}
		o.interp = string(bytes.TrimRight(b, "\x00"))
	}
	if o.needed, err = f.ImportedLibraries(); err != nil {
		return nil, fmt.Errorf("read ELF %s: DT_NEEDED: %w", p, err)
	}
	split := func(tag elf.DynTag) ([]string, error) {
		vals, err := f.DynString(tag)
		if err != nil {
			return nil, fmt.Errorf("read ELF %s: %s: %w", p, tag, err)
		}
		var dirs []string
		for _, v := range vals {
			for _, d := range strings.Split(v, ":") {
				if d != "" {
					dirs = append(dirs, d)
				}
			}
		}
		return dirs, nil
	}
	if o.rpath, err = split(elf.DT_RPATH); err != nil {
		return nil, err
	}
	if o.runpath, err = split(elf.DT_RUNPATH); err != nil {
		return nil, err
	}
	return o, nil
}

// multiarch maps an ELF machine (64-bit) to its Debian multiarch triplet.
var multiarch = map[elf.Machine]string{
	elf.EM_X86_64:  "x86_64-linux-gnu",
	elf.EM_AARCH64: "aarch64-linux-gnu",
	elf.EM_PPC64:   "powerpc64le-linux-gnu",
	elf.EM_S390:    "s390x-linux-gnu",
	elf.EM_RISCV:   "riscv64-linux-gnu",
}

// LibrarySearchDirs returns, in search order, the default directories in which AddDynamicBinary
// looks for a shared library needed by an ELF object of the given machine (after the object's
// own DT_RPATH or DT_RUNPATH): the Debian multiarch directories /lib/<triplet> and
// /usr/lib/<triplet> when the machine has a known triplet, then /lib64, /usr/lib64, /lib and
// /usr/lib.
func LibrarySearchDirs(machine elf.Machine) []string {
	var dirs []string
	if t, ok := multiarch[machine]; ok {
		dirs = append(dirs, "/lib/"+t, "/usr/lib/"+t)
	}
	return append(dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib")
}

// compatible reports whether the host file p is an ELF object of the given class and machine.
func compatible(p string, class elf.Class, machine elf.Machine) bool {
	f, err := elf.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	return f.Class == class && f.Machine == machine
}

// findLibrary returns the host path of the library name needed by the object at host path
// from, searched the way the dynamic loader does (without ld.so.cache or LD_LIBRARY_PATH).
func findLibrary(name, from string, o *elfObject) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	var dirs []string
	if len(o.runpath) == 0 {
		dirs = append(dirs, o.rpath...)
	}
	dirs = append(dirs, o.runpath...)
	dirs = append(dirs, LibrarySearchDirs(o.machine)...)
	origin := filepath.Dir(from)
	for _, d := range dirs {
		d = strings.NewReplacer("${ORIGIN}", origin, "$ORIGIN", origin).Replace(d)
		if !filepath.IsAbs(d) {
			continue
		}
		p := filepath.Join(d, name)
		if compatible(p, o.class, o.machine) {
			return p, nil
		}
	}
	return "", fmt.Errorf("shared library %s needed by %s: not found in %s", name, from, strings.Join(dirs, ":"))
}

// AddDynamicBinary copies the ELF executable src (a host path) to image path dst and, when it
// is dynamically linked, also the dynamic loader named by its PT_INTERP and every shared library
// it needs, recursively (DT_NEEDED of the binary and of each library), each found the way the
// dynamic loader finds it (DT_RPATH/DT_RUNPATH with $ORIGIN, then LibrarySearchDirs, skipping
// files of another ELF class or machine; no ld.so.cache) and copied, symlinks followed, to the
// same path inside the image as on this machine (for example /lib/x86_64-linux-gnu/libc.so.6
// and /lib64/ld-linux-x86-64.so.2), so the loader's built-in search finds them. As the loader
// does, a needed name already provided (the loader's own file name included) is not looked up
// again. Files already
// present at those image paths are overwritten. The binary keeps src's mode; libraries get
// 0755 (the loader) or 0644. A static binary is copied alone.
//
// $ORIGIN in the binary's own RUNPATH is expanded from src, so it only works in the image when
// dst's directory matches src's layout. It returns the image paths written, dst first. Errors
// name the ELF file or library that could not be read or found.
func (r *Rootfs) AddDynamicBinary(src, dst string) (added []string, err error) {
	bin, err := readELF(src)
	if err != nil {
		return nil, err
	}
	if err := r.AddFile(src, dst, 0); err != nil {
		return nil, err
	}
	dst = path.Clean("/" + dst)
	added = []string{dst}
	seen := map[string]bool{dst: true}
	add := func(hostPath string, mode os.FileMode) error {
		p := path.Clean("/" + filepath.ToSlash(hostPath))
		if seen[p] {
			return nil
		}
		seen[p] = true
		if err := r.AddFile(hostPath, p, mode); err != nil {
			return err
		}
		added = append(added, p)
		return nil
	}
	// The loader matches a needed name against the sonames already loaded, itself included;
	// file names stand in for sonames here.
	loaded := map[string]bool{}
	if bin.interp != "" {
		loaded[path.Base(bin.interp)] = true
		if !compatible(bin.interp, bin.class, bin.machine) {
			return nil, fmt.Errorf("dynamic loader %s of %s: missing or not an ELF of the same machine", bin.interp, src)
		}
		if err := add(bin.interp, 0o755); err != nil {
			return nil, err
		}
	}
	type item struct {
		from string
		obj  *elfObject
	}
	queue := []item{{src, bin}}
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		for _, name := range it.obj.needed {
			if loaded[name] {
				continue
			}
			loaded[name] = true
			lib, err := findLibrary(name, it.from, it.obj)
			if err != nil {
				return nil, err
			}
			p := path.Clean("/" + filepath.ToSlash(lib))
			if seen[p] {
				continue
			}
			o, err := readELF(lib)
			if err != nil {
				return nil, err
			}
			if err := add(lib, 0o644); err != nil {
				return nil, err
			}
			queue = append(queue, item{lib, o})
		}
	}
	return added, nil
}
