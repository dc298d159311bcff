package commands

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// Checkpoints on a node's disk: the kubelet writes one archive per checkpoint API call into its
// checkpoint directory and never deletes one (kubernetes#115888); berth's checkpoint root holds
// what restore pods restore from. ls lists both, rm removes named ones, gc applies a retention
// policy (the newest N per container, a byte budget), which the agent DaemonSet (its gc container) of
// contrib/kubernetes runs on every node.

// DefaultKubeletCheckpointDir is where the kubelet checkpoint API writes archives
// (<kubelet root>/checkpoints).
const DefaultKubeletCheckpointDir = "/var/lib/kubelet/checkpoints"

// stored is one checkpoint on disk: an archive or a directory.
type stored struct {
	Path string `json:"path"`
	// Where is "kubelet" (the kubelet's checkpoint directory) or "berth" (the checkpoint root).
	Where string `json:"where"`
	// Container is "namespace/pod/container" (Kubernetes) or the containerd id the manifest
	// records; the file name when no manifest can be read.
	Container string    `json:"container"`
	Bytes     int64     `json:"bytes"`
	Modified  time.Time `json:"modified"`
	// Removed is set by gc on what it removed (or, with --dry-run, would remove), with the reason.
	Removed string `json:"removed,omitempty"`
}

// storeFlags are the directories ls, rm and gc look in.
type storeFlags struct {
	kubeletDir, root string
}

func addStoreFlags(fs *pflag.FlagSet) *storeFlags {
	s := &storeFlags{}
	fs.StringVar(&s.kubeletDir, "kubelet-dir", DefaultKubeletCheckpointDir, "the kubelet's checkpoint directory (\"\" to leave it out)")
	fs.StringVar(&s.root, "root", checkpoint.DefaultRoot, "berth's checkpoint root (default: checkpoint_root of --config); \"none\" to leave it out")
	return s
}

// dirs returns the directories to look in, by kind.
func (s *storeFlags) dirs(g *Globals, fs *pflag.FlagSet) (map[string]string, error) {
	out := map[string]string{}
	if s.kubeletDir != "" {
		out["kubelet"] = s.kubeletDir
	}
	if s.root != "none" {
		root, err := g.checkpointRoot(fs, s.root)
		if err != nil {
			return nil, err
		}
		out["berth"] = root
	}
	return out, nil
}

// listStored lists the checkpoints directly under each directory of dirs (a missing directory
// holds none), oldest first.
func listStored(dirs map[string]string) ([]stored, error) {
	var out []stored
	for where, dir := range dirs {
		ents, err := os.ReadDir(dir)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list checkpoints: %w", err)
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				continue // a receiver's staging directory, stamps, a restore's extraction: never a checkpoint
			}
			p := filepath.Join(dir, e.Name())
			info, err := os.Lstat(p)
			if err != nil {
				continue // removed meanwhile
			}
			s := stored{Path: p, Where: where, Modified: info.ModTime(), Container: e.Name()}
			switch {
			case info.Mode().IsRegular() && strings.HasSuffix(e.Name(), ".tar"):
				s.Bytes = info.Size()
				if a, err := readArchive(p); err == nil {
					s.Container = cmp.Or(containerKey(a.Manifest), s.Container)
				}
			case info.IsDir():
				m, err := checkpoint.ReadManifest(p)
				if err != nil {
					if m, err = checkpoint.ReadManifest(filepath.Join(p, checkpoint.ImagesDir)); err != nil {
						continue // not a checkpoint: never touched
					}
				}
				s.Container = cmp.Or(containerKey(m), s.Container)
				s.Bytes = dirBytes(p)
			default:
				continue
			}
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b stored) int {
		return cmp.Or(a.Modified.Compare(b.Modified), cmp.Compare(a.Path, b.Path))
	})
	return out, nil
}

// containerKey names the container a checkpoint is of, for grouping; "" when m names none.
func containerKey(m *checkpoint.Manifest) string {
	c := m.Container
	switch {
	case c.Pod != "" || c.KubernetesNamespace != "":
		return c.KubernetesNamespace + "/" + c.Pod + "/" + c.ContainerName
	case c.ID != "":
		return c.Namespace + "/" + c.ID
	}
	return ""
}

func dirBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// gcPolicy is what gc keeps.
type gcPolicy struct {
	// Keep is how many of each container's newest checkpoints are kept (0: no such rule).
	Keep int
	// MaxBytes bounds the bytes all checkpoints take (0: no bound): the oldest go first, except
	// each container's newest, which only Keep and age decide.
	MaxBytes int64
	// MinAge protects what is younger (being written, or about to be restored by a pod).
	MinAge time.Duration
}

// plan marks in list (oldest first) what p removes at now, and returns the indexes, oldest first.
func (p gcPolicy) plan(list []stored, now time.Time) []int {
	young := func(s stored) bool { return now.Sub(s.Modified) < p.MinAge }
	// newest first per container: rank 0 is the newest
	rank := make([]int, len(list))
	seen := map[string]int{}
	for i := len(list) - 1; i >= 0; i-- {
		rank[i] = seen[list[i].Container]
		seen[list[i].Container]++
	}
	var total int64
	for _, s := range list {
		total += s.Bytes
	}
	var out []int
	for i := range list {
		if p.Keep > 0 && rank[i] >= p.Keep && !young(list[i]) {
			list[i].Removed = fmt.Sprintf("more than the newest %d of %s", p.Keep, list[i].Container)
			total -= list[i].Bytes
			out = append(out, i)
		}
	}
	for i := range list {
		if p.MaxBytes <= 0 || total <= p.MaxBytes {
			break
		}
		if list[i].Removed != "" || rank[i] == 0 || young(list[i]) {
			continue
		}
		list[i].Removed = fmt.Sprintf("checkpoints over %s", humanBytes(p.MaxBytes))
		total -= list[i].Bytes
		out = append(out, i)
	}
	slices.Sort(out)
	return out
}

// CheckpointLs is `berthctl checkpoint ls`.
func CheckpointLs(g *Globals) *cobra.Command {
	var (
		store  *storeFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "ls [--kubelet-dir DIR] [--root DIR] [-o text|json]",
		Short: "List the checkpoints on this node: the kubelet's archives and berth's checkpoint root",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			dirs, err := store.dirs(g, cmd.Flags())
			if err != nil {
				return err
			}
			list, err := listStored(dirs)
			if err != nil {
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), emptyIfNil(list))
			}
			printStored(cmd, list, false)
			return nil
		},
	}
	store = addStoreFlags(cmd.Flags())
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	return cmd
}

func emptyIfNil(l []stored) []stored {
	if l == nil {
		return []stored{}
	}
	return l
}

func printStored(cmd *cobra.Command, list []stored, removed bool) {
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	defer tw.Flush()
	if removed {
		fmt.Fprintln(tw, "REMOVED\tWHERE\tCONTAINER\tSIZE\tAGE\tWHY")
	} else {
		fmt.Fprintln(tw, "CHECKPOINT\tWHERE\tCONTAINER\tSIZE\tAGE")
	}
	var total int64
	for _, s := range list {
		age := time.Since(s.Modified).Round(time.Second)
		if removed {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.Path, s.Where, s.Container, humanBytes(s.Bytes), age, s.Removed)
		} else {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", s.Path, s.Where, s.Container, humanBytes(s.Bytes), age)
		}
		total += s.Bytes
	}
	noun := "checkpoints"
	if len(list) == 1 {
		noun = "checkpoint"
	}
	fmt.Fprintf(tw, "%d %s\t\t\t%s\n", len(list), noun, humanBytes(total))
}

// CheckpointRm is `berthctl checkpoint rm`.
func CheckpointRm(g *Globals) *cobra.Command {
	var (
		store *storeFlags
		force bool
	)
	cmd := &cobra.Command{
		Use:   "rm [--kubelet-dir DIR] [--root DIR] [--force] CHECKPOINT...",
		Short: "Remove checkpoints (names or paths that ls lists) from this node",
		Long: `rm removes each named checkpoint: a name or path that 'berthctl checkpoint ls' lists, in the
kubelet's checkpoint directory or berth's checkpoint root. Anything else is refused, except that
with --force a name that is not there is skipped (a rollback that may run twice). The CRIU logs
the shim kept beside a checkpoint of restores that failed (CHECKPOINT.restore-ID.log) go with it.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dirs, err := store.dirs(g, cmd.Flags())
			if err != nil {
				return err
			}
			list, err := listStored(dirs)
			if err != nil {
				return err
			}
			for _, a := range args {
				i := slices.IndexFunc(list, func(s stored) bool { return s.Path == a || filepath.Base(s.Path) == a })
				if abs, err := filepath.Abs(a); i < 0 && err == nil {
					i = slices.IndexFunc(list, func(s stored) bool { return s.Path == abs })
				}
				if i < 0 {
					if force {
						continue
					}
					return fmt.Errorf("checkpoint rm %s: %w: not a checkpoint in %v", a, fs.ErrNotExist, dirs)
				}
				if err := os.RemoveAll(list[i].Path); err != nil {
					return fmt.Errorf("checkpoint rm: %w", err)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "removed %s (%s)\n", list[i].Path, humanBytes(list[i].Bytes))
				// the CRIU logs the shim kept beside it of restores that failed
				// (CHECKPOINT.restore-ID.log) go with it
				logs, _ := filepath.Glob(globQuote(list[i].Path) + ".restore-*.log")
				for _, l := range logs {
					if err := os.Remove(l); err != nil && !errors.Is(err, fs.ErrNotExist) {
						return fmt.Errorf("checkpoint rm: %w", err)
					}
					fmt.Fprintf(cmd.OutOrStdout(), "removed %s\n", l)
				}
			}
			return nil
		},
	}
	store = addStoreFlags(cmd.Flags())
	cmd.Flags().BoolVarP(&force, "force", "f", false, "a checkpoint that is not there is no error")
	return cmd
}

// globQuote escapes the characters filepath.Match treats as patterns in a path.
func globQuote(p string) string {
	var b strings.Builder
	for _, r := range p {
		if strings.ContainsRune(`*?[\\`, r) {
			b.WriteRune('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// CheckpointGC is `berthctl checkpoint gc`.
func CheckpointGC(g *Globals) *cobra.Command {
	var (
		store    *storeFlags
		output   *format
		p        gcPolicy
		dryRun   bool
		interval time.Duration
	)
	cmd := &cobra.Command{
		Use:   "gc [--keep N] [--max-bytes B] [--min-age D] [--dry-run] [--interval D]",
		Short: "Remove old checkpoints: keep the newest N per container and stay under a byte budget",
		Long: `gc applies a retention policy to the kubelet's checkpoint directory (the kubelet writes one
archive per checkpoint API call and never deletes one: kubernetes#115888) and berth's checkpoint
root: beyond the newest --keep of each container (namespace/pod/container, from the manifest), and
then, oldest first, until all of them take at most --max-bytes; each container's newest checkpoint
is removed by --keep only. Nothing younger than --min-age is removed (an archive being written, or
one a restore pod is about to restore). It prints what it removed. --interval runs it again and
again (the gc container of the agent DaemonSet).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if p.Keep < 0 || p.MaxBytes < 0 {
				return fmt.Errorf("--keep and --max-bytes must not be negative")
			}
			if p.Keep == 0 && p.MaxBytes == 0 {
				return fmt.Errorf("give --keep, --max-bytes or both")
			}
			dirs, err := store.dirs(g, cmd.Flags())
			if err != nil {
				return err
			}
			for {
				list, err := listStored(dirs)
				if err != nil {
					return err
				}
				var gone []stored
				for _, i := range p.plan(list, time.Now()) {
					if !dryRun {
						if err := os.RemoveAll(list[i].Path); err != nil {
							return fmt.Errorf("checkpoint gc: %w", err)
						}
					}
					gone = append(gone, list[i])
				}
				if output.json() {
					if err := writeJSON(cmd.OutOrStdout(), emptyIfNil(gone)); err != nil {
						return err
					}
				} else {
					printStored(cmd, gone, true)
				}
				if interval <= 0 {
					return nil
				}
				select {
				case <-cmd.Context().Done():
					return nil
				case <-time.After(interval):
				}
			}
		},
	}
	store = addStoreFlags(cmd.Flags())
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	cmd.Flags().IntVar(&p.Keep, "keep", 0, "keep the newest N checkpoints of each container (0: no such rule)")
	cmd.Flags().Int64Var(&p.MaxBytes, "max-bytes", 0, "remove the oldest until the checkpoints take at most B bytes (0: no bound)")
	cmd.Flags().DurationVar(&p.MinAge, "min-age", 5*time.Minute, "never remove a checkpoint younger than this")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print what would be removed, remove nothing")
	cmd.Flags().DurationVar(&interval, "interval", 0, "run again every D until stopped (0: once)")
	return cmd
}
