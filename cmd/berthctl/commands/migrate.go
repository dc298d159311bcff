package commands

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer"
)

// Migrate is `berthctl migrate`: the source is the containerd of g unless --from names another.
func Migrate(g *Globals) *cobra.Command {
	var (
		from, to, receiver, root, newID, workDir, name, logPath, mode string
		leaveRunning, keep, keepFailed, lazyFlag                      bool
		pauseLease                                                    time.Duration
		tf                                                            *tlsFlags
		trust                                                         *trustFlags
		output                                                        *format
		nf                                                            nodeFlags
	)
	cmd := &cobra.Command{
		Use:   "migrate [--from SOCKET] --to SOCKET [-n NS] [--id ID] [--root DIR | --receiver HOST:PORT [--tls-ca CA --tls-cert CERT --tls-key KEY]] [-o text|json] CONTAINER",
		Short: "Move a running container to another containerd node: checkpoint, send, verify, restore, stop the source",
		Long: `migrate checkpoints CONTAINER on the source containerd (--from, default the global -a/--address;
paused while it is dumped and moved), sends the checkpoint over a socket to a receiver that
verifies it into the destination's checkpoint root, restores it there with the berth runtime as
--id (default the same id), and only then stops the source (--leave-running keeps it). Without
--receiver, a receiver is started in this process on 127.0.0.1, writing into --root (the
destination shim's checkpoint_root). With --receiver HOST:PORT, a 'berthctl receive' already
running on the destination host is used: the same path across a network, over mutual TLS
(--tls-ca, --tls-cert, --tls-key) to anything but loopback.
The checkpoint is signed with this node's key (signing_key of --config, or --signing-key) before
it leaves, and the receiver, in this process too, keeps it only when a key it trusts signed it;
the destination's shim checks the signature again before it restores.

--mode copy (the default) sends the memory pages from CRIU straight to the destination, never to
this node's disk: CRIU's page client reaches a relay in this process on 127.0.0.1, which carries
the stream to the receiver on a connection of its own (mutual TLS like the checkpoint's) and
hashes it; the receiver feeds it to a 'criu page-server' it runs on a socket of its own and
hashes it again. The page stream's digest is signed with the rest of the checkpoint, and the
receiver keeps the pages only when both digests agree (contrib/TRUST.md); that checkpoint cannot
be sent on from the destination ('berthctl send' refuses it: only that receiver verified its
pages). --mode stored writes the whole checkpoint here first, then sends it. Either way the
source is stopped only after the destination serves: downtime and the source's teardown are
reported apart.

--mode lazy (or --lazy) is post-copy: CRIU dumps everything but the memory, the destination
restores from that and resumes at once, and the memory pages follow from the source's CRIU,
on demand when the destination task touches a page and in the background until it has them all,
over a connection of their own to the receiver (mutual TLS like the checkpoint's; the receiver
runs 'criu lazy-pages' on a socket of its own). The source stays frozen, not killed, until every
page has arrived; only then is it stopped ("all pages arrived" is that wait, after the
downtime). If the link, the destination, its lazy-pages daemon or the source's CRIU fails
before that, the destination task is killed and removed, the source resumes where it was
frozen, and migrate fails saying so. What a client observes in that window: the destination
answers from the moment it resumed (a request that touches memory not yet arrived waits for
those pages, so the first answers are slower); if the move then fails, the destination's
connections break and whatever it answered or changed in memory since it resumed is lost, the
source continuing from its state at the freeze; writes to volumes or other services outside the
container's memory are not undone. The pages are covered by the connection's authentication,
not by the checkpoint's signature (contrib/TRUST.md). On the source, CRIU serves the pages on
127.0.0.1 to one connection, over TLS with an identity made for this move alone (its key files
in the work directory until the relay connected): a local process that connects first is served
no page, but the move fails (the source resumes; one that holds the connection is cut off by the
source's shim 5 s after the move gave up). Up-front, before anything is paused: CRIU
on this node needs fs.pipe-max-size >= 4 MiB or CAP_SYS_RESOURCE, the destination userfaultfd;
each refusal says how to fix it. --leave-running resumes the source once every page arrived.
The receiver's lazy-pages daemon runs under a guard process ('berthctl lazy-guard', its own
session) that outlives this process and the receiver: if either dies, or the daemon fails,
before every page arrived, the guard SIGKILLs the destination task's cgroup and waits until no
process is left before the daemon lets go of the task's memory (a page not yet arrived would
then read as zeros), and removes the container; the source resumes by its pause lease. Not
covered: the daemon itself killed or crashing (the task can read zeros for the milliseconds
until the guard killed it), the guard itself killed (contrib/TRUST.md).

It prints every phase's wall time: the checkpoint's own (checkpoint/..., the shim's as
checkpoint/shim/...) and the move's (checkpoint, transfer, restore, pages in lazy mode,
stop-source or resume-source), and what was sent: the checkpoint's own stream and, in copy and
lazy mode, the memory pages' stream beside it (-o json: bytes and pageBytes). -o json prints
them with CRIU's dump statistics.

Before anything is paused, the destination is checked (the same preflight as 'berthctl checkpoint
check'): the image with the source's digest, namespaces joined by path, the memory limit against
the source's memory now and, on the destination node, every bind source, free memory, PIDs in
a shared host PID namespace and free disk under --root (this host without --receiver; with
--receiver the 'berthctl receive' there answers them; a receiver too old to answer is warned
about and skipped). With --gpu (this host's GPUs), the device memory the source's processes hold
on them is checked too: free on GPUs of the same models on the destination (this host's GPUs,
or with --receiver the receiving node's, when its receive runs with --gpu). Each refusal
names the field, its value and what the container needs. A failed move removes the checkpoint
the in-process receiver wrote unless --keep-failed.

The source holds a pause lease (--pause-lease, default 30s) from before it is paused until the
move is decided, renewed while migrate runs: if migrate dies (SIGKILL included), berth's shim
resumes the source by itself when the lease ends, and removes the checkpoint it wrote into
--work-dir (the source's memory). 'ctr -n NS tasks ls' shows a paused source,
'ctr -n NS tasks resume ID' resumes it at once.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) (retErr error) {
			ctx := cmd.Context()
			id := args[0]
			defer func() {
				if retErr != nil && !strings.HasPrefix(retErr.Error(), "migrate ") {
					retErr = fmt.Errorf("migrate %s: %w", id, retErr)
				}
			}()
			if to == "" {
				return fmt.Errorf("--to is required (the destination containerd socket)")
			}
			fromFlag := "--from"
			if from == "" {
				from, fromFlag = g.Address, g.addressFlag()
			}
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			if newID == "" {
				newID = id
			}
			if lazyFlag {
				if cmd.Flags().Changed("mode") && mode != modeLazy {
					return fmt.Errorf("--lazy and --mode %s: --lazy is --mode %s", mode, modeLazy)
				}
				mode = modeLazy
			}
			if mode != modeCopy && mode != modeStored && mode != modeLazy {
				return fmt.Errorf("--mode %q: want %s, %s or %s", mode, modeCopy, modeLazy, modeStored)
			}
			if mode == modeLazy {
				// CRIU serves the pages from this node: it needs its pipes (the destination's
				// userfaultfd is checked by its receiver, before anything is paused)
				if err := criu.CheckLazyDump(); err != nil {
					return fmt.Errorf("--mode %s: nothing was paused: %w", modeLazy, err)
				}
			}
			if receiver == "" && tf.files.Enabled() {
				return fmt.Errorf("%s apply to --receiver: the receiver in this process listens on loopback", transfer.TLSFlags)
			}
			// the keys first: a move that would be refused costs no pause
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			if err := checkSigner(policy, g, "the checkpoint", cmd.ErrOrStderr()); err != nil {
				return err
			}
			if receiver == "" {
				if root, err = g.checkpointRoot(cmd.Flags(), root); err != nil {
					return err
				}
			}
			// where the source's memory goes, before anything else: another local user must not
			// have prepared it
			if workDir == "" {
				workDir = filepath.Join(os.TempDir(), "berth-migrate")
			}
			if err := os.MkdirAll(filepath.Dir(workDir), 0o700); err != nil {
				return fmt.Errorf("--work-dir: %w", err)
			}
			if err := os.Mkdir(workDir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("--work-dir: %w", err)
			}
			if err := checkWorkDir(workDir); err != nil {
				return fmt.Errorf("migrate %s: nothing was paused: --work-dir: %w", id, err)
			}
			src, err := connect(ctx, fromFlag, "source", from)
			if err != nil {
				return err
			}
			defer src.Close()
			dst, err := connect(ctx, "--to", "destination", to)
			if err != nil {
				return err
			}
			defer dst.Close()
			if err := targetFree(ctx, dst, ns, newID); err != nil {
				return err
			}
			// the destination preflight, before anything is paused (move.Preflight)
			need, err := move.NeedOfSource(ctx, src, ns, id)
			if err != nil {
				return err
			}
			dstLocal := move.Destination{Client: dst, Namespace: ns, Local: receiver == "", Root: root}
			h, err := nf.open()
			if err != nil {
				return err
			}
			// the fingerprint the checkpoint will be taken against, for the receiving node to
			// compare (best effort: without CRIU here, the shim still compares at restore)
			if fp, err := h.fingerprint(ctx); err == nil {
				need.Fingerprint = &fp
			}
			if h.gpu != nil {
				// this host's GPUs: what the source holds on them, and a destination on this host
				if need.GPU, err = move.GPUNeedOfSource(h.gpu.Inventory(), need.PIDs); err != nil {
					return fmt.Errorf("migrate %s: nothing was paused: %w", id, err)
				}
				dstLocal.GPUs = h.gpu.Inventory()
			}
			if name == "" {
				name = fmt.Sprintf("%s-%s", id, time.Now().UTC().Format("20060102T150405Z"))
			}
			perr := move.Preflight(ctx, dstLocal, need)
			var pe *move.PreflightError
			if perr != nil && !errors.As(perr, &pe) {
				return fmt.Errorf("migrate %s: nothing was paused: %w", id, perr)
			}
			var local, remote []move.Refusal
			if pe != nil {
				local = pe.Refusals
			}
			if receiver != "" {
				// the host-only checks, answered by the receiving node (one connection of its own)
				if remote, err = remotePreflight(ctx, receiver, tf, name, need); err != nil {
					if !errors.Is(err, transfer.ErrNoPreflight) {
						return fmt.Errorf("migrate %s: nothing was paused: %w", id, err)
					}
					fmt.Fprintf(cmd.ErrOrStderr(), "warning: %v: the receiving node's own checks (bind sources, free memory, PIDs, free disk, fingerprint, GPU memory) did not run\n", err)
				}
			}
			if err := move.MergeRefusals(local, remote); err != nil {
				return fmt.Errorf("migrate %s: nothing was paused: %w", id, err)
			}
			addr := receiver
			if addr == "" {
				ln, err := transfer.Listen("127.0.0.1:0", nil)
				if err != nil {
					return err
				}
				defer ln.Close()
				// The in-process receiver does not fsync: a migration restores the checkpoint at
				// once, and if anything fails the source is resumed, so the copy never has to
				// outlive a crash. A standalone `berthctl receive` keeps checkpoints durably.
				rcv := &transfer.Receiver{Root: root, NoSync: true, LazyGuard: lazyGuardArgv(), Verify: func(ctx context.Context, dir string) error {
					_, err := verifyCheckpoint(ctx, policy, dir, cmd.ErrOrStderr())
					return err
				}}
				if mode != modeStored {
					if _, err := rcv.PageServer(); err != nil {
						return fmt.Errorf("migrate %s --mode %s: nothing was paused: %w", id, mode, err)
					}
				}
				go rcv.Serve(ctx, ln) //nolint:errcheck // ends with ln.Close
				addr = ln.Addr().String()
			}
			// dial the receiver before the source is paused: an unreachable, busy or wrong
			// destination costs nothing
			conn, err := dialReceiver(ctx, addr, tf)
			if err != nil {
				return err
			}
			defer conn.Close()
			send := func(ctx context.Context, dir, name string) (int64, error) {
				return sendOn(ctx, cmd.ErrOrStderr(), conn, dir, name, false)
			}
			mo := move.MigrateOptions{
				Src: src, Dst: dst, Namespace: ns, ID: id, TargetID: newID,
				WorkDir: filepath.Join(workDir, name), KeepLocal: keep, Name: name,
				Send: send, Sign: policy.Sign,
				LeaveRunning: leaveRunning, LogPath: logPath, PauseLease: pauseLease,
			}
			switch mode {
			case modeCopy:
				mo.Pages = pageRelay(addr, tf)
			case modeLazy:
				mo.Lazy = lazyRelay(addr, tf)
			}
			res, err := move.Migrate(ctx, mo)
			if err != nil {
				if receiver == "" && !keepFailed {
					// the in-process receiver wrote it here: a failed move leaves no checkpoint behind,
					// nor the pages a copy-mode stream brought (this process may exit before the
					// receiver's handler removed them)
					os.RemoveAll(filepath.Join(root, name))
					_ = transfer.RemovePagesStaging(root, name)
				}
				return err
			}
			r := newMigrateResult(res)
			r.Container, r.ID, r.Namespace, r.From, r.To, r.Receiver, r.Checkpoint = id, newID, ns, from, to, addr, name
			r.SignedBy, r.Mode = res.SignedBy, mode
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), r)
			}
			r.writeText(cmd.OutOrStdout())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "source containerd socket (default: -a/--address)")
	f.StringVar(&to, "to", "", "destination containerd socket (required)")
	f.StringVar(&newID, "id", "", "id of the new container on the destination (default: CONTAINER)")
	deprecatedAlias(f, &newID, "target-id", "id")
	f.StringVar(&root, "root", "", "destination checkpoint root, for the in-process receiver (default: checkpoint_root of --config, else "+checkpoint.DefaultRoot+")")
	deprecatedAlias(f, &root, "to-root", "root")
	f.StringVar(&receiver, "receiver", "", "HOST:PORT of a 'berthctl receive' on the destination (default: one in this process)")
	f.StringVar(&workDir, "work-dir", "", "where the source checkpoint is written (default $TMPDIR/berth-migrate); it must be a directory (no symbolic link) of root or of this user that group and others cannot write")
	f.StringVar(&name, "name", "", "checkpoint name in the destination root (default CONTAINER-TIMESTAMP)")
	f.StringVar(&logPath, "log", "", "file for the restored task's stdout/stderr on the destination")
	f.BoolVar(&leaveRunning, "leave-running", false, "keep the source container running after the move")
	f.DurationVar(&pauseLease, "pause-lease", move.DefaultPauseLease, "if this process dies mid-move, berth's shim resumes the paused source at most this long after its last renewal")
	f.BoolVar(&keepFailed, "keep-failed", false, "keep the checkpoint received by the destination when the move fails (with the in-process receiver; a remote 'berthctl receive' keeps what it verified)")
	nf.add(f)
	f.BoolVar(&keep, "keep-local", false, "keep the source-side checkpoint directory after the move")
	f.StringVar(&mode, "mode", modeCopy, "copy (the default): memory pages go from CRIU straight to the destination (never to this node's disk); lazy: post-copy, the destination resumes before the memory arrived, the pages follow on demand and in the background while the source stays frozen; stored: the whole checkpoint is written here, then sent")
	f.BoolVar(&lazyFlag, "lazy", false, "the same as --mode lazy")
	tf = addTLSFlags(f)
	trust = addTrustFlags(f, true, true)
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// migrateResult is what `berthctl migrate` prints (-o json: as JSON).
type migrateResult struct {
	// Container is the source container's id, ID the new container's on the destination.
	Container string `json:"container"`
	ID        string `json:"id"`
	Namespace string `json:"namespace"`
	// From and To are the source's and destination's containerd sockets; Receiver the address
	// the checkpoint was sent to.
	From     string `json:"from"`
	To       string `json:"to"`
	Receiver string `json:"receiver"`
	// Checkpoint is the checkpoint's name in the destination's checkpoint root; SignedBy the id
	// of the key that signed it ("" when unsigned, under allow_unsigned).
	Checkpoint string `json:"checkpoint"`
	SignedBy   string `json:"signedBy,omitempty"`
	// Bytes is the checkpoint directory's stream sent to the receiver, in bytes: in copy and
	// lazy mode without the memory pages, which PageBytes counts.
	Bytes int64 `json:"bytes"`
	// PageBytes (copy and lazy mode) is what the page stream carried to the destination, in
	// bytes: copy mode, the pages CRIU streamed while it dumped (the signed manifest's
	// pageStream size); lazy mode, what CRIU's lazy page server sent after the destination
	// resumed. Bytes + PageBytes is all that was sent.
	PageBytes int64 `json:"pageBytes,omitempty"`
	// Phases are every measured step, in order: the checkpoint's own as checkpoint/NAME (the
	// shim's as checkpoint/shim/NAME, its GPU steps included), then the move's (checkpoint,
	// transfer, restore, stop-source or resume-source).
	Phases []checkpoint.Phase `json:"phases"`
	// Mode is copy, lazy or stored.
	Mode string `json:"mode"`
	// TotalMs is the sum of the move's phases (the checkpoint/... ones are inside "checkpoint").
	TotalMs float64 `json:"totalMs"`
	// DowntimeMs is the part of TotalMs before the destination serves (checkpoint, transfer,
	// restore: the source is paused from the checkpoint's pause on); AfterMs the rest (stopping
	// and removing the source, or resuming it), which is off the critical path.
	DowntimeMs float64 `json:"downtimeMs"`
	AfterMs    float64 `json:"afterMs"`
	// PagesMs (lazy mode) is the time from the destination's resume until every page had
	// arrived (phase pages), part of AfterMs: the source stays frozen meanwhile, and the
	// destination's task waits for each page it touches that has not arrived yet.
	PagesMs float64 `json:"pagesMs,omitempty"`
	// CRIU is CRIU's dump statistics; GPU the container's GPU state (nil without GPUs).
	CRIU checkpoint.CRIUStats `json:"criu"`
	GPU  *checkpoint.GPUState `json:"gpu,omitempty"`
}

// newMigrateResult gathers the phases and statistics of res; the caller names the rest.
func newMigrateResult(res *move.MigrateResult) migrateResult {
	r := migrateResult{Bytes: res.Bytes, PageBytes: res.PageBytes, Phases: []checkpoint.Phase{}}
	if m := res.Manifest; m != nil {
		for _, p := range m.Phases {
			r.Phases = append(r.Phases, checkpoint.Phase{Name: "checkpoint/" + p.Name, Ms: p.Ms})
		}
		r.CRIU, r.GPU = m.CRIU, m.GPU
	}
	for _, p := range res.Phases {
		r.Phases = append(r.Phases, p)
		r.TotalMs += p.Ms
		if p.Name == "pages" {
			r.PagesMs = p.Ms
		}
		if p.Name == "stop-source" || p.Name == "resume-source" || p.Name == "pages" {
			r.AfterMs += p.Ms
		} else {
			r.DowntimeMs += p.Ms
		}
	}
	return r
}

func (r migrateResult) writeText(w io.Writer) {
	signed := "unsigned"
	if r.SignedBy != "" {
		signed = "signed by " + r.SignedBy
	}
	sent := humanBytes(r.Bytes)
	if r.PageBytes > 0 {
		pages := "pages streamed"
		if r.Mode == modeLazy {
			pages = "pages after the resume"
		}
		sent = fmt.Sprintf("%s checkpoint + %s %s = %s", sent, humanBytes(r.PageBytes), pages, humanBytes(r.Bytes+r.PageBytes))
	}
	fmt.Fprintf(w, "migrated %s -> %s as %s (%s sent, checkpoint %s, %s)\n", r.Container, r.To, r.ID, sent, r.Checkpoint, signed)
	for _, p := range r.Phases {
		fmt.Fprintf(w, "  %-32s %9.1f ms\n", p.Name, p.Ms)
	}
	fmt.Fprintf(w, "  %-32s %9.1f ms\n", "total", r.TotalMs)
	fmt.Fprintf(w, "  %-32s %9.1f ms (source paused until the destination serves)\n", "downtime", r.DowntimeMs)
	if r.PagesMs > 0 {
		fmt.Fprintf(w, "  %-32s %9.1f ms (after the destination serves; the source stays frozen)\n", "all pages arrived", r.PagesMs)
	}
	if r.PagesMs > 0 {
		fmt.Fprintf(w, "  %-32s %9.1f ms (after the destination serves: all pages arrived, then the source stopped)\n", "source teardown", r.AfterMs)
	} else {
		fmt.Fprintf(w, "  %-32s %9.1f ms (after the destination serves)\n", "source teardown", r.AfterMs)
	}
}

// targetFree returns an error when container id already exists in namespace ns of c: a move or
// restore under that id would fail only after the checkpoint was taken and sent.
func targetFree(ctx context.Context, c *containerd.Client, ns, id string) error {
	if _, err := c.LoadContainer(namespaces.WithNamespace(ctx, ns), id); err == nil {
		return fmt.Errorf("--id %s: container %s already exists on the destination (namespace %s): remove it or choose another id", id, id, ns)
	}
	return nil
}

// errUnsafeWorkDir: the work directory could be written, or replaced, by another user.
var errUnsafeWorkDir = errors.New("unsafe work directory")

// checkWorkDir refuses a work directory another local user could have prepared or could write
// into: the default, $TMPDIR/berth-migrate, lies in a directory every user may create entries in,
// so one of them could have made it a symbolic link (to make berthctl, as root, write the
// checkpoint where they choose) or a directory of their own (and read or swap the source's
// memory). It must be a directory itself (not a symbolic link), owned by root or by the user
// berthctl runs as, without group or other write permission. Errors wrap errUnsafeWorkDir
// and name the path and what is wrong.
func checkWorkDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	switch {
	case fi.Mode()&os.ModeSymlink != 0:
		target, _ := os.Readlink(dir)
		return fmt.Errorf("%s is a symbolic link (to %q), not a directory: %w; remove it or give another --work-dir", dir, target, errUnsafeWorkDir)
	case !fi.IsDir():
		return fmt.Errorf("%s is a %v, not a directory: %w; remove it or give another --work-dir", dir, fi.Mode().Type(), errUnsafeWorkDir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%s: owner unknown: %w", dir, errUnsafeWorkDir)
	}
	if euid := uint32(os.Geteuid()); st.Uid != 0 && st.Uid != euid {
		return fmt.Errorf("%s is owned by uid %d, not by root or uid %d (berthctl): %w; remove it or give another --work-dir", dir, st.Uid, euid, errUnsafeWorkDir)
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("%s has mode %v: group or others may write it: %w; chmod go-w it or give another --work-dir", dir, perm, errUnsafeWorkDir)
	}
	return nil
}
