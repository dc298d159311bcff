package transfer

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// TestKillCgroup: every process listed in the procs file is killed, and KillCgroup returns
// once the file lists none (here the test empties it once the child is reaped, as the kernel
// does for a cgroup); a procs file that is gone means nothing is left.
func TestKillCgroup(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	procs := filepath.Join(t.TempDir(), "cgroup.procs")
	if err := os.WriteFile(procs, []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	reaped := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		_ = os.WriteFile(procs, nil, 0o600)
		reaped <- err
	}()
	n, err := KillCgroup(procs, 10*time.Second)
	if err != nil || n != 1 {
		t.Fatalf("KillCgroup = %d, %v; want 1, nil", n, err)
	}
	if err := <-reaped; err == nil || err.Error() != "signal: killed" {
		t.Fatalf("child ended with %v, want signal: killed", err)
	}
	if n, err := KillCgroup(filepath.Join(t.TempDir(), "gone"), time.Second); n != 0 || err != nil {
		t.Fatalf("gone cgroup: %d, %v", n, err)
	}
}
