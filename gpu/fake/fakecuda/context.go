// Package fakecuda is the in-process half of berth's fake GPU: a tiny "CUDA runtime" that a test
// workload links to hold "device memory" on the fake GPUs mounted into its container (see package
// gpu/fake), and that answers the CUDA driver's process checkpoint API (lock, checkpoint, restore,
// unlock) over a unix socket, with the real driver's states and failure modes.
//
// Device memory is a MAP_SHARED mapping of a file "mem-..." in the GPU's directory
// (/dev/berth-gpu/<i>/, bind-mounted from the node's fake GPU root): it lives outside the
// process's dumpable memory. CRIU records such a mapping by path, and that path does not exist on
// another node, so a checkpoint that skips the GPU steps cannot be restored there. Checkpoint
// moves every buffer's data into private anonymous memory at the same address (which CRIU dumps)
// and deletes the files; Restore writes the data into new files on the (possibly remapped) GPUs
// and maps them back at the same addresses, so the process's pointers stay valid. While a process
// is LOCKED or CHECKPOINTED, Do and Malloc block, as CUDA calls do; in FAILED they fail.
//
// Device memory is accounted per GPU as the driver does (see Account): it counts against the
// GPU's memory while its process lives and is freed once the process has exited, however it
// exited; a Malloc or a Restore the GPU's free memory cannot take is refused with
// gpu.ErrOutOfMemory, or, for a Restore where the GPU's RestoreWhenFullFile says FullHang, never
// answers, as the real driver's can.
//
// What does not belong here: the node side (gpu/fake) and the shim's driver (gpu/fake.Driver).
package fakecuda

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu"
)

// Options configure Init. Zero fields take the defaults.
type Options struct {
	// DevRoot is the directory holding one directory per GPU, named 0..n-1 in the container's
	// device order (default DefaultDevRoot).
	DevRoot string
	// SocketDir is where the control socket "<pid>.sock" is created (default DefaultSocketDir).
	SocketDir string
}

// Device is one fake GPU as the process sees it.
type Device struct {
	// Index is the container's device order (the directory name under DevRoot).
	Index int
	// UUID is the GPU's UUID, from its UUIDFile.
	UUID string
	// Dir is the GPU's directory.
	Dir string
}

// buffer is one device memory allocation.
type buffer struct {
	addr   unsafe.Pointer
	size   int // requested
	mapLen int // size rounded up to pages; also the file's size
	uuid   string
	path   string // the mem file; "" while checkpointed
}

// Context is a process's fake CUDA context. Its methods are safe for concurrent use.
type Context struct {
	pid      int
	sockPath string
	ln       *net.UnixListener
	calls    chan call
	tid      int
	done     chan struct{}
	wg       sync.WaitGroup

	mu       sync.Mutex
	cond     *sync.Cond
	state    gpu.ProcessState
	failure  error // why the context is FAILED
	locking  bool
	inflight int
	devRoot  string
	devs     []Device
	bufs     []*buffer
	tag      string
	seq      int
	closed   bool
}

type call struct {
	req   Request
	reply chan Response
}

// ErrFailed is returned by Do and Malloc once the context is FAILED (a restore failed).
var ErrFailed = errors.New("fake CUDA context failed")

// ErrClosed is returned by Do and Malloc after Close.
var ErrClosed = errors.New("fake CUDA context closed")

// Init creates the process's context with the default options (see InitWith).
func Init() (*Context, error) { return InitWith(Options{}) }

// InitWith discovers the GPUs under opts.DevRoot (at least one), and starts the control server
// on opts.SocketDir/<pid>.sock, pid as this process sees it.
func InitWith(opts Options) (*Context, error) {
	if opts.DevRoot == "" {
		opts.DevRoot = DefaultDevRoot
	}
	if opts.SocketDir == "" {
		opts.SocketDir = DefaultSocketDir
	}
	devs, err := ScanDevices(opts.DevRoot)
	if err != nil {
		return nil, fmt.Errorf("fakecuda init: %w", err)
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("fakecuda init: no fake GPUs under %s", opts.DevRoot)
	}
	tag := make([]byte, 4)
	_, _ = rand.Read(tag)
	c := &Context{
		pid:     os.Getpid(),
		calls:   make(chan call),
		done:    make(chan struct{}),
		devRoot: opts.DevRoot,
		devs:    devs,
		tag:     hex.EncodeToString(tag),
	}
	c.cond = sync.NewCond(&c.mu)
	if err := os.MkdirAll(opts.SocketDir, 0o755); err != nil {
		return nil, fmt.Errorf("fakecuda init: %w", err)
	}
	c.sockPath = filepath.Join(opts.SocketDir, strconv.Itoa(c.pid)+".sock")
	if len(c.sockPath) >= 108 {
		return nil, fmt.Errorf("fakecuda init: socket path %s is too long for a unix socket", c.sockPath)
	}
	_ = os.Remove(c.sockPath)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: c.sockPath, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("fakecuda init: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	c.ln = ln
	tidc := make(chan int)
	c.wg.Add(2)
	go c.control(tidc)
	c.tid = <-tidc
	go c.accept()
	return c, nil
}

// ScanDevices lists the GPU directories under devRoot (named by non-negative integers) in
// index order, with the UUID each one's UUIDFile holds. A missing devRoot lists none.
func ScanDevices(devRoot string) ([]Device, error) {
	ents, err := os.ReadDir(devRoot)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var devs []Device
	for _, e := range ents {
		i, err := strconv.Atoi(e.Name())
		if err != nil || i < 0 {
			continue
		}
		dir := filepath.Join(devRoot, e.Name())
		b, err := os.ReadFile(filepath.Join(dir, UUIDFile))
		if err != nil {
			return nil, fmt.Errorf("fake GPU %s: %w", dir, err)
		}
		devs = append(devs, Device{Index: i, UUID: strings.TrimSpace(string(b)), Dir: dir})
	}
	sort.Slice(devs, func(a, b int) bool { return devs[a].Index < devs[b].Index })
	return devs, nil
}

// PID returns the process id the context serves (as the process sees it).
func (c *Context) PID() int { return c.pid }

// SocketPath returns the control socket's path.
func (c *Context) SocketPath() string { return c.sockPath }

// Devices returns the GPUs the context uses, in the container's device order.
func (c *Context) Devices() []Device {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Device(nil), c.devs...)
}

// UUIDs returns the UUIDs of the context's GPUs in device order (they change on a remapping
// restore).
func (c *Context) UUIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, len(c.devs))
	for i, d := range c.devs {
		out[i] = d.UUID
	}
	return out
}

// State returns the context's checkpoint state.
func (c *Context) State() gpu.ProcessState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state
}

// SetDevRoot changes the directory Restore looks for GPUs in. It is for in-process tests that
// simulate a move to another node; in a container the same path is bind-mounted elsewhere.
func (c *Context) SetDevRoot(dir string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.devRoot = dir
}

// enter waits until the context is RUNNING with no lock pending and counts one call in flight.
func (c *Context) enter() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		switch {
		case c.closed:
			return ErrClosed
		case c.state == gpu.StateFailed:
			return fmt.Errorf("%w: %v", ErrFailed, c.failure)
		case c.state == gpu.StateRunning && !c.locking:
			c.inflight++
			return nil
		}
		c.cond.Wait()
	}
}

func (c *Context) leave() {
	c.mu.Lock()
	c.inflight--
	c.cond.Broadcast()
	c.mu.Unlock()
}

// Do runs f as GPU work: it blocks while the context is LOCKED or CHECKPOINTED (or a lock is
// pending) and fails once it is FAILED or closed. Lock waits for f to return.
func (c *Context) Do(f func()) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.leave()
	f()
	return nil
}

// Malloc allocates bytes bytes of zeroed device memory on the context's GPU dev (device order)
// and returns it. Like Do, it blocks while the context is not RUNNING. It fails, wrapping
// gpu.ErrOutOfMemory and naming the GPU, the bytes requested and the bytes free, when the GPU's
// free memory (its MemoryFile, when present, less what live processes and reservations hold; see
// Account) is too small. Do not call it from inside Do.
func (c *Context) Malloc(dev, bytes int) ([]byte, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("fakecuda malloc: %d bytes", bytes)
	}
	if err := c.enter(); err != nil {
		return nil, fmt.Errorf("fakecuda malloc: %w", err)
	}
	defer c.leave()
	c.mu.Lock()
	defer c.mu.Unlock()
	if dev < 0 || dev >= len(c.devs) {
		return nil, fmt.Errorf("fakecuda malloc: device %d: have %d", dev, len(c.devs))
	}
	d := c.devs[dev]
	page := os.Getpagesize()
	mapLen := (bytes + page - 1) / page * page
	unlock, err := lockGPUs(d.Dir)
	if err != nil {
		return nil, fmt.Errorf("fakecuda malloc: %w", err)
	}
	defer unlock()
	if total, err := readUint(filepath.Join(d.Dir, MemoryFile)); err == nil {
		mem, err := account(d.Dir)
		if err != nil {
			return nil, fmt.Errorf("fakecuda malloc: %w", err)
		}
		if mem.Used+uint64(mapLen) > total {
			return nil, fmt.Errorf("fakecuda malloc: %d bytes requested on GPU %s, %d bytes free of %d: %w",
				bytes, d.UUID, free(total, mem.Used), total, gpu.ErrOutOfMemory)
		}
	}
	b := &buffer{size: bytes, mapLen: mapLen, uuid: d.UUID}
	path, fd, err := c.createMem(d.Dir, mapLen)
	if err != nil {
		return nil, fmt.Errorf("fakecuda malloc: %w", err)
	}
	p, err := unix.MmapPtr(fd, 0, nil, uintptr(mapLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(fd)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("fakecuda malloc: mmap %s: %w", path, err)
	}
	b.addr, b.path = p, path
	c.bufs = append(c.bufs, b)
	return unsafe.Slice((*byte)(p), bytes), nil
}

// Free releases device memory returned by Malloc.
func (c *Context) Free(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	if err := c.enter(); err != nil {
		return fmt.Errorf("fakecuda free: %w", err)
	}
	defer c.leave()
	c.mu.Lock()
	defer c.mu.Unlock()
	addr := unsafe.Pointer(&mem[0])
	for i, b := range c.bufs {
		if b.addr == addr {
			c.bufs = append(c.bufs[:i], c.bufs[i+1:]...)
			return b.release()
		}
	}
	return fmt.Errorf("fakecuda free: %p is not device memory", addr)
}

func (b *buffer) release() error {
	err := unix.MunmapPtr(b.addr, uintptr(b.mapLen))
	if b.path != "" {
		if rerr := os.Remove(b.path); err == nil && !errors.Is(rerr, os.ErrNotExist) {
			err = rerr
		}
	}
	return err
}

// Close stops the control server, removes the socket and frees all device memory. Device memory
// slices must not be used afterwards.
func (c *Context) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.cond.Broadcast()
	c.mu.Unlock()
	err := c.ln.Close()
	close(c.done)
	c.wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range c.bufs {
		if rerr := b.release(); err == nil {
			err = rerr
		}
	}
	c.bufs = nil
	return err
}

// createMem creates a new device memory file of size bytes in dir, returning its path and an
// open descriptor. The caller holds c.mu.
func (c *Context) createMem(dir string, size int) (string, int, error) {
	c.seq++
	path := filepath.Join(dir, fmt.Sprintf("%s%d-%s-%d", MemPrefix, c.pid, c.tag, c.seq))
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", -1, fmt.Errorf("create %s: %w", path, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		os.Remove(path)
		return "", -1, fmt.Errorf("truncate %s: %w", path, err)
	}
	return path, fd, nil
}

// DirMemoryUsed returns the sum of the sizes of the device memory files in a GPU directory, as
// they lie: files of exited processes included (Account frees those first).
func DirMemoryUsed(dir string) (uint64, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var sum uint64
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), MemPrefix) {
			continue
		}
		fi, err := e.Info()
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, err
		}
		sum += uint64(fi.Size())
	}
	return sum, nil
}

func free(total, used uint64) uint64 {
	if used > total {
		return 0
	}
	return total - used
}

func readUint(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
}

// accept serves control connections until the listener closes.
func (c *Context) accept() {
	defer c.wg.Done()
	for {
		conn, err := c.ln.AcceptUnix()
		if err != nil {
			select {
			case <-c.done:
				return
			default:
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		c.wg.Add(1)
		go c.serveConn(conn)
	}
}

func (c *Context) serveConn(conn *net.UnixConn) {
	defer c.wg.Done()
	defer conn.Close()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-c.done:
			conn.Close()
		case <-stop:
		}
	}()
	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	enc := json.NewEncoder(conn)
	for sc.Scan() {
		var req Request
		var resp Response
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			resp = Response{State: c.State(), Error: "bad request: " + err.Error(), Code: CodeBadRequest}
		} else {
			reply := make(chan Response, 1)
			select {
			case c.calls <- call{req: req, reply: reply}:
			case <-c.done:
				return
			}
			resp = <-reply
		}
		if err := enc.Encode(resp); err != nil {
			return
		}
	}
}

// control is the thread that performs every checkpoint operation (the "restore thread").
func (c *Context) control(tidc chan<- int) {
	defer c.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tidc <- unix.Gettid()
	for {
		select {
		case <-c.done:
			return
		case cl := <-c.calls:
			cl.reply <- c.handle(cl.req)
		}
	}
}

// opError is an operation's failure with its Response code.
type opError struct {
	code string
	err  error
}

func (e *opError) Error() string { return e.err.Error() }

func opErr(code, format string, args ...any) error {
	return &opError{code: code, err: fmt.Errorf(format, args...)}
}

func (c *Context) handle(req Request) Response {
	var resp Response
	var err error
	switch req.Op {
	case OpState:
	case OpRestoreThreadID:
		resp.TID = unix.Gettid()
	case OpLock:
		err = c.Lock(time.Duration(req.TimeoutMs) * time.Millisecond)
	case OpCheckpoint:
		err = c.Checkpoint()
	case OpRestore:
		err = c.Restore(req.Pairs, req.Driver)
	case OpUnlock:
		err = c.Unlock()
	case OpUsage:
		resp.Usage = c.Usage()
	default:
		err = opErr(CodeBadRequest, "unknown op %q", req.Op)
	}
	resp.State = c.State()
	if errors.Is(err, gpu.ErrOutOfMemory) {
		err = &opError{code: CodeOutOfMemory, err: err}
	}
	if err != nil {
		resp.Error = err.Error()
		resp.Code = CodeFailed
		var oe *opError
		if errors.As(err, &oe) {
			resp.Code = oe.code
		}
	}
	return resp
}

func (c *Context) illegal(op string) error {
	return opErr(CodeIllegalState, "%s in state %s", op, c.state)
}

// Lock moves RUNNING -> LOCKED: new Do and Malloc calls block and in-flight ones finish. If they
// do not finish within timeout (0: no limit) the context stays RUNNING and Lock times out.
func (c *Context) Lock(timeout time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != gpu.StateRunning || c.locking {
		return c.illegal("lock")
	}
	c.locking = true
	var expired bool
	if timeout > 0 {
		t := time.AfterFunc(timeout, func() {
			c.mu.Lock()
			expired = true
			c.cond.Broadcast()
			c.mu.Unlock()
		})
		defer t.Stop()
	}
	for c.inflight > 0 && !expired && !c.closed {
		c.cond.Wait()
	}
	c.locking = false
	if c.inflight > 0 {
		c.cond.Broadcast()
		return opErr(CodeTimeout, "lock: %d GPU calls still running after %v", c.inflight, timeout)
	}
	c.state = gpu.StateLocked
	return nil
}

// Unlock moves LOCKED -> RUNNING.
func (c *Context) Unlock() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != gpu.StateLocked {
		return c.illegal("unlock")
	}
	c.state = gpu.StateRunning
	c.cond.Broadcast()
	return nil
}

// Checkpoint moves LOCKED -> CHECKPOINTED: every buffer's data moves into private anonymous
// memory at the same address and its device memory file is deleted.
func (c *Context) Checkpoint() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != gpu.StateLocked {
		return c.illegal("checkpoint")
	}
	for _, b := range c.bufs {
		if err := b.toHost(); err != nil {
			c.fail(err)
			return opErr(CodeFailed, "checkpoint: %v", err)
		}
	}
	c.state = gpu.StateCheckpointed
	return nil
}

func (c *Context) fail(err error) {
	c.state, c.failure = gpu.StateFailed, err
	c.cond.Broadcast()
}

func (b *buffer) toHost() error {
	tmp, err := unix.MmapPtr(-1, 0, nil, uintptr(b.mapLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return fmt.Errorf("host memory for %s: %w", b.path, err)
	}
	copy(unsafe.Slice((*byte)(tmp), b.mapLen), unsafe.Slice((*byte)(b.addr), b.mapLen))
	// Atomically replace the shared file mapping with the anonymous copy, at the same address.
	_, _, errno := unix.Syscall6(unix.SYS_MREMAP, uintptr(tmp), uintptr(b.mapLen), uintptr(b.mapLen),
		unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, uintptr(b.addr), 0)
	if errno != 0 {
		unix.MunmapPtr(tmp, uintptr(b.mapLen))
		return fmt.Errorf("mremap over %s: %w", b.path, errno)
	}
	if err := os.Remove(b.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	b.path = ""
	return nil
}

// Restore moves CHECKPOINTED -> LOCKED: every buffer's data goes into a new device memory file
// on its GPU (same UUID, or pairs' New for its Old) found under the device root, mapped back at
// the same address. Remapping (a pair with New != Old) needs driver >= 580: driver is the node's
// version, or "" to read it from the first GPU's DriverFile; an older one is refused
// (unsupported, still CHECKPOINTED). A GPU that is not there fails the context (FAILED). A GPU
// whose free memory (see Account) is less than what the process needs on it does what its
// RestoreWhenFullFile says: FullRefuse (default) returns an error wrapping gpu.ErrOutOfMemory
// that names the GPU, the bytes needed and the bytes free, the context still CHECKPOINTED;
// FullHang never returns until the context is closed (the process exits).
func (c *Context) Restore(pairs []gpu.UUIDPair, driver string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != gpu.StateCheckpointed {
		return c.illegal("restore")
	}
	devs, err := ScanDevices(c.devRoot)
	if err != nil {
		c.fail(err)
		return opErr(CodeFailed, "restore: %v", err)
	}
	remap := map[string]string{}
	needRemap := false
	for _, p := range pairs {
		if _, dup := remap[p.Old]; dup {
			return opErr(CodeBadRequest, "restore: GPU %s mapped twice", p.Old)
		}
		remap[p.Old] = p.New
		if p.New != p.Old {
			needRemap = true
		}
	}
	if needRemap {
		if driver == "" && len(devs) > 0 {
			b, err := os.ReadFile(filepath.Join(devs[0].Dir, DriverFile))
			if err == nil {
				driver = strings.TrimSpace(string(b))
			}
		}
		major, _ := strconv.Atoi(strings.SplitN(driver, ".", 2)[0])
		if major < gpu.MinDriverRemap {
			return opErr(CodeUnsupported, "restore: remapping GPUs needs driver >= %d, node has %q", gpu.MinDriverRemap, driver)
		}
	}
	byUUID := map[string]Device{}
	for _, d := range devs {
		byUUID[d.UUID] = d
	}
	need := map[string]uint64{} // target UUID -> bytes
	from := map[string][]string{}
	var dirs []string
	for _, b := range c.bufs {
		target := b.uuid
		if n, ok := remap[b.uuid]; ok {
			target = n
		}
		d, ok := byUUID[target]
		if !ok {
			err := fmt.Errorf("restore: GPU %s (checkpointed on %s) is not present under %s", target, b.uuid, c.devRoot)
			c.fail(err)
			return &opError{code: CodeFailed, err: err}
		}
		if _, seen := need[target]; !seen {
			dirs = append(dirs, d.Dir)
		}
		need[target] += uint64(b.mapLen)
		if !slices.Contains(from[target], b.uuid) {
			from[target] = append(from[target], b.uuid)
		}
	}
	unlock, err := lockGPUs(dirs...)
	if err != nil {
		return opErr(CodeFailed, "restore: %v", err) // nothing placed: still CHECKPOINTED
	}
	for _, d := range devs {
		n, ok := need[d.UUID]
		if !ok {
			continue
		}
		total, err := readUint(filepath.Join(d.Dir, MemoryFile))
		if err != nil {
			continue // no memory size: no limit
		}
		mem, err := account(d.Dir)
		if err != nil {
			unlock()
			return opErr(CodeFailed, "restore: GPU %s: %v", d.UUID, err)
		}
		if mem.Used+n <= total {
			continue
		}
		mode, merr := restoreWhenFull(d.Dir)
		unlock()
		if merr != nil {
			return opErr(CodeFailed, "restore: %v", merr)
		}
		if mode == FullHang {
			// The real driver's stuck case: no answer, ever; the process must be killed.
			for !c.closed {
				c.cond.Wait()
			}
			return opErr(CodeFailed, "restore: GPU %s full, hung until the context closed", d.UUID)
		}
		return fmt.Errorf("restore: GPU %s (checkpointed on %s): %d bytes needed, %d bytes free of %d: %w",
			d.UUID, strings.Join(from[d.UUID], ","), n, free(total, mem.Used), total, gpu.ErrOutOfMemory)
	}
	defer unlock()
	for _, b := range c.bufs {
		target := b.uuid
		if n, ok := remap[b.uuid]; ok {
			target = n
		}
		if err := c.toDevice(b, byUUID[target]); err != nil {
			c.fail(err)
			return opErr(CodeFailed, "restore: %v", err)
		}
	}
	c.devs = devs
	c.state = gpu.StateLocked
	return nil
}

// toDevice writes b's data to a new memory file on d and maps it over b. The caller holds c.mu.
func (c *Context) toDevice(b *buffer, d Device) error {
	path, fd, err := c.createMem(d.Dir, b.mapLen)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	data := unsafe.Slice((*byte)(b.addr), b.mapLen)
	for off := 0; off < len(data); {
		n, err := unix.Pwrite(fd, data[off:], int64(off))
		if err != nil {
			os.Remove(path)
			return fmt.Errorf("write %s: %w", path, err)
		}
		off += n
	}
	if _, err := unix.MmapPtr(fd, 0, b.addr, uintptr(b.mapLen), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
		os.Remove(path)
		return fmt.Errorf("mmap %s: %w", path, err)
	}
	b.path, b.uuid = path, d.UUID
	return nil
}

// Usage returns the context's device memory per GPU UUID in bytes (while CHECKPOINTED: what was
// checkpointed, per GPU it came from).
func (c *Context) Usage() map[string]uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := map[string]uint64{}
	for _, b := range c.bufs {
		u[b.uuid] += uint64(b.mapLen)
	}
	return u
}
