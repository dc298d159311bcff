package checkpoint

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
)

// criUnsignedFiles are the top-level files of a CRI checkpoint archive that containerd's CRI
// plugin (v2.4, internal/cri/server/container_checkpoint_linux.go) writes after berth's shim
// signed the CRIU images in ImagesDir, so no signature covers them. A restore never reads any of
// them, except rootfs-diff.tar, which is applied only when a signature covers it (a top-level
// berth.json of `berthctl checkpoint push`) or under allow_unsigned; dump.log and stats-dump
// are CRIU's (present only when containerd set CRIU's work directory there).
var criUnsignedFiles = []string{
	ConfigFile,      // config.dump: the container's CRI metadata
	SpecFile,        // spec.dump: the container's OCI spec
	RootfsDiffFile,  // rootfs-diff.tar: the writable layer's changes
	StatsDumpFile,   // stats-dump: CRIU's statistics
	DumpLogFile,     // dump.log: CRIU's log
	"status",        // containerd's container status file, for checkpointctl
	"status.dump",   // the CRI ContainerStatus as JSON
	"container.log", // the container's log so far
}

// CRIUnsignedFiles returns the names of the top-level files a CRI checkpoint archive may carry
// beside ImagesDir, outside the signature (criUnsignedFiles), sorted.
func CRIUnsignedFiles() []string {
	out := slices.Clone(criUnsignedFiles)
	slices.Sort(out)
	return out
}

// CheckCRIEntry checks one entry of a CRI checkpoint (one whose only berth manifest is
// ImagesDir/berth.json) that lies outside ImagesDir: name is its path relative to the checkpoint
// (slash-separated), isDir whether it is a directory. Only the files containerd's CRI plugin
// writes at the top (CRIUnsignedFiles) pass, as regular files: anything else (another name, a
// subdirectory, a berth file such as berth-rootfs-diff.tar placed at the top) is a file no
// signature covers and would be refused wherever it could be read, so it is refused everywhere.
// It returns nil or an error wrapping ErrExtraFile that names the entry.
func CheckCRIEntry(name string, isDir bool) error {
	name = path.Clean(name)
	if name == "." || name == ImagesDir {
		return nil
	}
	if !isDir && slices.Contains(criUnsignedFiles, name) {
		return nil
	}
	return fmt.Errorf("%s: %w: a CRI checkpoint carries outside %s/ only the files containerd writes there (%v), which the restore does not read; nothing covers this one, so it is refused",
		name, ErrExtraFile, ImagesDir, CRIUnsignedFiles())
}

// CheckCRITop checks the top level of the CRI checkpoint directory dir with CheckCRIEntry: every
// entry but ImagesDir must be one of containerd's files. withStamp also allows StampDir holding
// only the stamp of ImagesDir (ImagesDir + ".json"), which a receiver writes into a CRI
// checkpoint it verified (the receiver's and the shim's own directories; never in an archive).
// Errors wrap ErrExtraFile (naming the entry) or ErrUnsupportedFile (a symbolic link or special
// file), or are the directory read's.
func CheckCRITop(dir string, withStamp bool) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("check %s: %w", dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		if withStamp && name == StampDir && e.IsDir() {
			if err := checkStampDir(filepath.Join(dir, name)); err != nil {
				return err
			}
			continue
		}
		if !e.IsDir() && !e.Type().IsRegular() {
			return fmt.Errorf("%s: %w", name, ErrUnsupportedFile)
		}
		if err := CheckCRIEntry(name, e.IsDir()); err != nil {
			return err
		}
	}
	return nil
}

// checkStampDir allows only the stamp of ImagesDir in a CRI checkpoint's StampDir.
func checkStampDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("check %s: %w", dir, err)
	}
	for _, e := range entries {
		if e.Name() != ImagesDir+".json" || !e.Type().IsRegular() {
			return fmt.Errorf("%s/%s: %w: a receiver's %s holds only %s.json", StampDir, e.Name(), ErrExtraFile, StampDir, ImagesDir)
		}
	}
	return nil
}
