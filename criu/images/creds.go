package images

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"

	"github.com/berth-dev/berth/oci/privilege"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"github.com/checkpoint-restore/go-criu/v7/magic"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// ErrBadImage is wrapped by ReadProcesses's errors for an image file that is not what CRIU
// writes: wrong magic, an entry larger than the file, a file over its size limit, a missing
// or duplicated thread, a thread without credentials.
var ErrBadImage = errors.New("malformed criu image")

// Limits on what ReadProcesses reads from an images directory that may be hostile. CRIU's
// core-<tid>.img is a few KiB (registers, FPU state, signal actions); pstree.img holds a few
// bytes per process and thread. Each file is read whole into memory, one at a time.
const (
	maxPstreeImage = 4 << 20
	maxCoreImage   = 1 << 20
	// maxThreads bounds the threads of all processes together.
	maxThreads = 1 << 16
)

// CRIU's image names and magics (images/magic.h), and the task state of a zombie
// (compel's COMPEL_TASK_DEAD, core_entry.tc.task_state).
const (
	pstreeImage  = "pstree.img"
	pstreeMagic  = "PSTREE"
	coreMagic    = "CORE"
	seccompImage = "seccomp.img"
	seccompMagic = "SECCOMP"
	// seccompTSync is SECCOMP_FILTER_FLAG_TSYNC in a seccomp_filter's flags (linux/seccomp.h)
	seccompTSync = 1
	// maxSeccompImage bounds seccomp.img, in bytes (every filter of every process)
	maxSeccompImage = 4 << 20
	taskStateDead   = 2
	capWordsPerSet  = 2 // CRIU's CR_CAP_SIZE: a capability set is two u32 words, low word first
)

var imgMagic = magic.LoadMagic()

// ReadProcesses reads the credentials of every thread of every process in a CRIU images
// directory: the process tree from pstree.img, and for each thread its core-<tid>.img
// (thread_core.creds and thread_core.seccomp_mode, as CRIU 4.x writes them), decoded into
// go-criu's crit bindings (crit/images/pstree, crit/images/criu-core). Processes come in
// pstree order, each main thread first; zombies (task state dead: CRIU restores them as
// exited processes that run no code) are left out.
//
// A thread whose image lacks no_new_privs or cap_amb (a CRIU that did not record them) reads
// as without them. Each thread's seccomp mode is the one CRIU's restore gives it (seccompOf),
// not the one its image seems to state: the main thread's task core's old_seccomp_mode wins
// over its thread core's, a missing mode is disabled, and a thread left without seccomp whose
// process installs a chain with SECCOMP_FILTER_FLAG_TSYNC (CRIU stores a chain shared by every
// thread on the main thread only) reads as filtered. A creds field this reader does not know is
// an error.
//
// Each file must be a regular file within its size limit (pstree 4 MiB, core 1 MiB) and hold
// well-formed entries; the tree at most 65536 threads. Errors name the file; a missing file
// matches fs.ErrNotExist, a malformed one ErrBadImage.
func ReadProcesses(imagesDir string) ([]privilege.Process, error) {
	threads, err := readProcesses(func(name string, limit int64) ([]byte, error) {
		return readImageFile(filepath.Join(imagesDir, name), limit)
	})
	if err != nil {
		return nil, err
	}
	out := make([]privilege.Process, len(threads))
	for i, t := range threads {
		out[i] = t.Process
	}
	return out, nil
}

// readProcesses is ReadProcesses over read, which returns the bytes of image file name (at
// most limit of them) or an error naming it.
func readProcesses(read func(name string, limit int64) ([]byte, error)) ([]thread, error) {
	b, err := read(pstreeImage, maxPstreeImage)
	if err != nil {
		return nil, fmt.Errorf("criu: read processes: %w", err)
	}
	entries, err := decodeImage(pstreeImage, b, pstreeMagic, maxThreads, &pstree.PstreeEntry{})
	if err != nil {
		return nil, fmt.Errorf("criu: read processes: %w", err)
	}
	// The tree first, before any core is read: every process among its own threads, no
	// thread twice, not too many. Each process's main thread comes first: its core holds the
	// process's state and name.
	type process struct {
		pid     uint32
		threads []uint32
	}
	var procs []process
	seen := map[uint32]bool{}
	for _, m := range entries {
		e := m.(*pstree.PstreeEntry)
		pid, threads := e.GetPid(), e.GetThreads()
		if pid == 0 || !slices.Contains(threads, pid) {
			return nil, fmt.Errorf("criu: read processes: %s: %w: process %d has threads %v, without itself",
				pstreeImage, ErrBadImage, pid, threads)
		}
		for _, tid := range threads {
			if seen[tid] {
				return nil, fmt.Errorf("criu: read processes: %s: %w: thread %d listed twice", pstreeImage, ErrBadImage, tid)
			}
			if seen[tid] = true; len(seen) > maxThreads {
				return nil, fmt.Errorf("criu: read processes: %s: %w: more than %d threads", pstreeImage, ErrBadImage, maxThreads)
			}
		}
		order := append([]uint32{pid}, slices.DeleteFunc(slices.Clone(threads), func(t uint32) bool { return t == pid })...)
		procs = append(procs, process{pid, order})
	}

	filters, err := readSeccompFilters(read)
	if err != nil {
		return nil, fmt.Errorf("criu: read processes: %w", err)
	}
	var out []thread
	for _, proc := range procs {
		var leader *criucore.CoreEntry
		var cores []*criucore.CoreEntry
		var ps []privilege.Process
		for _, tid := range proc.threads {
			name := fmt.Sprintf("core-%d.img", tid)
			b, err := read(name, maxCoreImage)
			if err != nil {
				return nil, fmt.Errorf("criu: read processes: %w", err)
			}
			entries, err := decodeImage(name, b, coreMagic, 1, &criucore.CoreEntry{})
			if err != nil {
				return nil, fmt.Errorf("criu: read processes: %w", err)
			}
			if len(entries) != 1 {
				return nil, fmt.Errorf("criu: read processes: %s: %w: %d entries, want 1", name, ErrBadImage, len(entries))
			}
			core := entries[0].(*criucore.CoreEntry)
			if tid == proc.pid {
				leader = core
				if core.GetTc() == nil {
					return nil, fmt.Errorf("criu: read processes: %s: %w: main thread without task core", name, ErrBadImage)
				}
				if core.GetTc().GetTaskState() == taskStateDead {
					break // a zombie: CRIU restores it as exited, its threads are not restored
				}
			}
			p, err := fromCore(name, int(proc.pid), int(tid), core, leader)
			if err != nil {
				return nil, fmt.Errorf("criu: read processes: %w", err)
			}
			ps = append(ps, p)
			cores = append(cores, core)
		}
		if len(ps) == 0 {
			continue
		}
		sc, err := seccompOf(proc.pid, cores, filters)
		if err != nil {
			return nil, fmt.Errorf("criu: read processes: %w", err)
		}
		for i := range ps {
			ps[i].Seccomp = sc[i].mode
			out = append(out, thread{Process: ps[i], chain: sc[i].chain})
		}
	}
	return out, nil
}

// thread is one thread's credentials and, in filter mode, its seccomp filter chain (indexes
// into seccomp.img's filters, oldest first).
type thread struct {
	privilege.Process
	chain []uint32
}

// threadSeccomp is a thread's seccomp mode and filter chain as CRIU's restore sets them.
type threadSeccomp struct {
	mode  privilege.SeccompMode
	chain []uint32 // oldest first; nil unless mode is filter
}

// seccompOf returns the seccomp mode and filter chain CRIU's restore gives each thread of process
// pid (cores: its threads' core images, main thread first), exactly as CRIU 4.x decides them
// (cr-restore.c check_core, seccomp.c seccomp_prepare_threads, pie/restorer.c
// restore_seccomp_filter), not as the images appear to say:
//   - a thread's mode is its thread core's seccomp_mode, disabled when absent; the main thread's
//     is replaced by its task core's old_seccomp_mode when that is present (images of CRIU
//     before per-thread seccomp), and its filter by old_seccomp_filter, which also makes every
//     filter it installs synchronise the whole process (SECCOMP_FILTER_FLAG_TSYNC);
//   - a thread in filter mode installs the chain from its seccomp_filter (0 when absent)
//     through each filter's prev, oldest first;
//   - a filter installed with SECCOMP_FILTER_FLAG_TSYNC gives its chain to every other thread of
//     the process: the threads in disabled mode end with it.
//
// Errors wrap ErrBadImage: a chain that points outside seccomp.img or loops (CRIU would fail or
// hang), a filter whose length is not whole instructions.
func seccompOf(pid uint32, cores []*criucore.CoreEntry, filters []*seccomp.SeccompFilter) ([]threadSeccomp, error) {
	out := make([]threadSeccomp, len(cores))
	forceTSync := false
	var idx []uint32
	for i, core := range cores {
		tc := core.GetThreadCore()
		mode := privilege.SeccompDisabled
		if tc.SeccompMode != nil {
			mode = privilege.SeccompMode(tc.GetSeccompMode())
		}
		fi := tc.GetSeccompFilter()
		if i == 0 {
			if t := core.GetTc(); t.OldSeccompMode != nil {
				mode = privilege.SeccompMode(t.GetOldSeccompMode())
			}
			if t := core.GetTc(); t.OldSeccompFilter != nil {
				fi, forceTSync = t.GetOldSeccompFilter(), true
			}
		}
		out[i].mode = mode
		idx = append(idx, fi)
	}
	tsyncChain := -1 // the thread whose chain a TSYNC install gives the others
	for i := range out {
		if out[i].mode != privilege.SeccompFilter {
			continue
		}
		chain, tsync, err := filterChain(filters, idx[i])
		if err != nil {
			return nil, fmt.Errorf("%s: %w: process %d, thread %d: %w", seccompImage, ErrBadImage, pid, i, err)
		}
		out[i].chain = chain
		if (tsync || forceTSync) && tsyncChain < 0 {
			tsyncChain = i
		}
	}
	if tsyncChain >= 0 {
		for i := range out {
			if out[i].mode == privilege.SeccompDisabled {
				out[i] = threadSeccomp{mode: privilege.SeccompFilter, chain: out[tsyncChain].chain}
			}
		}
	}
	return out, nil
}

// filterChain returns the chain of filters ending at index last (oldest first), following prev,
// and whether any of them carries SECCOMP_FILTER_FLAG_TSYNC.
func filterChain(filters []*seccomp.SeccompFilter, last uint32) (chain []uint32, tsync bool, _ error) {
	i := last
	for range len(filters) + 1 {
		if int(i) >= len(filters) {
			return nil, false, fmt.Errorf("filter %d of %d", i, len(filters))
		}
		f := filters[i]
		if len(f.GetFilter())%8 != 0 {
			return nil, false, fmt.Errorf("filter %d is %d bytes, not whole instructions", i, len(f.GetFilter()))
		}
		chain = append([]uint32{i}, chain...)
		tsync = tsync || f.GetFlags()&seccompTSync != 0
		if f.Prev == nil {
			return chain, tsync, nil
		}
		i = f.GetPrev()
	}
	return nil, false, fmt.Errorf("the chain from filter %d loops", last)
}

// readSeccompFilters returns the filters of seccomp.img (none when CRIU wrote no such file: no
// thread had a filter).
func readSeccompFilters(read func(name string, limit int64) ([]byte, error)) ([]*seccomp.SeccompFilter, error) {
	b, err := read(seccompImage, maxSeccompImage)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	entries, err := decodeImage(seccompImage, b, seccompMagic, 1, &seccomp.SeccompEntry{})
	if err != nil {
		return nil, err
	}
	if len(entries) == 0 {
		return nil, nil
	}
	return entries[0].(*seccomp.SeccompEntry).GetSeccompFilters(), nil
}

// fromCore returns the credentials of thread tid of process pid from its core entry (and
// its process's main thread's, for the name and a per-process seccomp mode).
func fromCore(name string, pid, tid int, core, leader *criucore.CoreEntry) (privilege.Process, error) {
	tc := core.GetThreadCore()
	c := tc.GetCreds()
	if c == nil {
		return privilege.Process{}, fmt.Errorf("%s: %w: thread %d has no credentials", name, ErrBadImage, tid)
	}
	p := privilege.Process{
		PID: pid, TID: tid, Comm: tc.GetComm(),
		UID: c.GetUid(), EUID: c.GetEuid(), SUID: c.GetSuid(), FSUID: c.GetFsuid(),
		GID: c.GetGid(), EGID: c.GetEgid(), SGID: c.GetSgid(), FSGID: c.GetFsgid(),
		Groups:     slices.Clone(c.GetGroups()),
		Securebits: c.GetSecbits(),
		LSMProfile: c.GetLsmProfile(),
	}
	if p.Comm == "" {
		p.Comm = leader.GetTc().GetComm()
	}
	var err error
	for _, s := range []struct {
		field string
		words []uint32
		set   *privilege.CapSet
	}{
		{"cap_eff", c.GetCapEff(), &p.CapEff},
		{"cap_prm", c.GetCapPrm(), &p.CapPrm},
		{"cap_inh", c.GetCapInh(), &p.CapInh},
		{"cap_bnd", c.GetCapBnd(), &p.CapBnd},
	} {
		if *s.set, err = capSet(s.words); err != nil {
			return privilege.Process{}, fmt.Errorf("%s: %w: thread %d %s: %w", name, ErrBadImage, tid, s.field, err)
		}
	}
	nnp, amb, err := credsTail(c.ProtoReflect().GetUnknown())
	if err != nil {
		return privilege.Process{}, fmt.Errorf("%s: %w: thread %d creds: %w", name, ErrBadImage, tid, err)
	}
	p.NoNewPrivs = nnp
	if p.CapAmb, err = capSet(amb); err != nil {
		return privilege.Process{}, fmt.Errorf("%s: %w: thread %d cap_amb: %w", name, ErrBadImage, tid, err)
	}
	return p, nil
}

// capSet converts CRIU's words (low word first) to a set. Words past the second must be 0.
func capSet(words []uint32) (privilege.CapSet, error) {
	var s privilege.CapSet
	for i, w := range words {
		if i >= capWordsPerSet {
			if w != 0 {
				return 0, fmt.Errorf("capability bits %#x in word %d, past capability 63", w, i)
			}
			continue
		}
		s |= privilege.CapSet(w) << (32 * i)
	}
	return s, nil
}

// The creds_entry fields CRIU 4.x writes that go-criu v7's creds.proto predates (CRIU 4.2.1
// images/creds.proto: "optional uint32 no_new_privs = 18; repeated uint32 cap_amb = 19;"). go-criu
// keeps them as unknown fields of its CredsEntry. (go-criu v8 has the fields but registers the
// same proto files as v7, whose rpc and stats this package links.)
const (
	credsNoNewPrivs protowire.Number = 18
	credsCapAmb     protowire.Number = 19
)

// credsTail decodes no_new_privs and cap_amb from a CredsEntry's unknown fields with protowire,
// as the protobuf runtime decodes proto2 fields: no_new_privs is a varint (the last one wins),
// cap_amb varints, one per field or packed. Any other field, or one of the two with another wire
// type, is an error: a CRIU newer than this reader may record credentials it would restore and
// this reader would not check. (A hand-written decoder rather than a dynamicpb message over a
// built descriptor: that descriptor was built at package init, and protodesc and dynamicpb
// are linked into every container's shim only for these two fields.)
func credsTail(unknown []byte) (nnp bool, amb []uint32, err error) {
	for b := unknown; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false, nil, protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == credsNoNewPrivs && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false, nil, protowire.ParseError(n)
			}
			b, nnp = b[n:], uint32(v) != 0
		case num == credsCapAmb && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false, nil, protowire.ParseError(n)
			}
			b, amb = b[n:], append(amb, uint32(v))
		case num == credsCapAmb && typ == protowire.BytesType:
			packed, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false, nil, protowire.ParseError(n)
			}
			b = b[n:]
			for len(packed) > 0 {
				v, k := protowire.ConsumeVarint(packed)
				if k < 0 {
					return false, nil, protowire.ParseError(k)
				}
				packed, amb = packed[k:], append(amb, uint32(v))
			}
		default:
			return false, nil, fmt.Errorf("creds field %d (wire type %d) not understood", num, typ)
		}
	}
	return nnp, amb, nil
}

// readImageFile reads image file path, at most limit bytes: it must be a regular file (not a
// link, FIFO or device, which could block or never end).
func readImageFile(path string, limit int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s: %w: a symbolic link", path, ErrBadImage)
		}
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w: not a regular file (%s)", path, ErrBadImage, st.Mode().Type())
	}
	if st.Size() > limit {
		return nil, fmt.Errorf("%s: %w: %d bytes, over the limit of %d", path, ErrBadImage, st.Size(), limit)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: %w: grew over the limit of %d bytes while read", path, ErrBadImage, limit)
	}
	return b, nil
}

// decodeImage decodes image file name's bytes b, which must carry magic want and at most
// maxEntries entries, each into a new message of entry's type (go-criu's crit bindings).
//
// The layout is CRIU's (images/magic.h, criu/protobuf.c) and go-criu crit's: one or two
// 4-byte little-endian magics, then entries, each a 4-byte little-endian size and that many
// bytes of protobuf. The sizes are checked against the bytes left before anything is
// decoded. (crit.New(...).Decode reads the same layout but allocates whatever size an entry
// claims before reading it, picks a decoder by the file's magic, and its package cannot be
// linked beside go-criu v7's stats package, which stats.go uses: both register stats_entry,
// and the protobuf runtime panics at start.)
func decodeImage(name string, b []byte, want string, maxEntries int, entry proto.Message) ([]proto.Message, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("%s: %w: %d bytes, shorter than a magic", name, ErrBadImage, len(b))
	}
	off, m := 4, uint64(binary.LittleEndian.Uint32(b))
	if m == imgMagic.ByName["IMG_COMMON"] || m == imgMagic.ByName["IMG_SERVICE"] {
		if len(b) < 8 {
			return nil, fmt.Errorf("%s: %w: %d bytes, shorter than two magics", name, ErrBadImage, len(b))
		}
		off, m = 8, uint64(binary.LittleEndian.Uint32(b[4:]))
	}
	if m != imgMagic.ByName[want] {
		return nil, fmt.Errorf("%s: %w: magic %#x, want %s (%#x)", name, ErrBadImage, m, want, imgMagic.ByName[want])
	}
	var out []proto.Message
	for off < len(b) {
		if len(out) == maxEntries {
			return nil, fmt.Errorf("%s: %w: more than %d entries", name, ErrBadImage, maxEntries)
		}
		if len(b)-off < 4 {
			return nil, fmt.Errorf("%s: %w: %d stray bytes at offset %d", name, ErrBadImage, len(b)-off, off)
		}
		size := binary.LittleEndian.Uint32(b[off:])
		if uint64(size) > uint64(len(b)-off-4) {
			return nil, fmt.Errorf("%s: %w: entry of %d bytes at offset %d, file holds %d more",
				name, ErrBadImage, size, off, len(b)-off-4)
		}
		msg := entry.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(b[off+4:off+4+int(size)], msg); err != nil {
			return nil, fmt.Errorf("%s: %w: entry %d at offset %d: %w", name, ErrBadImage, len(out), off, err)
		}
		out = append(out, msg)
		off += 4 + int(size)
	}
	return out, nil
}
