package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// redisCLI runs the host's redis-cli inside the network namespace of pid.
func redisCLI(ctx context.Context, pid uint32, args ...string) (string, error) {
	full := append([]string{"-t", fmt.Sprint(pid), "-n", "redis-cli", "-h", "127.0.0.1", "-p", "6379"}, args...)
	out, err := exec.CommandContext(ctx, "nsenter", full...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("redis-cli %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// TestMigrateRedis moves a Redis server (Debian's redis-server, a program nobody here wrote)
// holding 256 MiB of values between nodes and checks every key: the key count and Redis's own
// digest of the whole dataset (DEBUG DIGEST) are the same after the move.
func TestMigrateRedis(t *testing.T) { migrateRedis(t, "redis-e2e") }

// migrateRedis is TestMigrateRedis for the container id, with extra berthctl migrate arguments.
func migrateRedis(t *testing.T, id string, migrateArgs ...string) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	moved := id + "-moved"
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), id)
		_ = dst.Remove(context.Background(), moved)
	})
	args := append(append([]string{}, image.RedisEntrypoint...), "--enable-debug-command", "yes")
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.RedisRef, Args: args, LogPath: filepath.Join(src.Dir, id+".log")})
	if err != nil {
		t.Fatal(err)
	}
	var pong string
	for i := 0; i < 100; i++ {
		if pong, err = redisCLI(ctx, pid, "PING"); err == nil && pong == "PONG" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if pong != "PONG" {
		t.Fatalf("redis not ready: %v %q", err, pong)
	}
	// 262144 keys of 1 KiB values: 256 MiB of data.
	const keys = 262144
	if out, err := redisCLI(ctx, pid, "DEBUG", "POPULATE", fmt.Sprint(keys), "key", "1024"); err != nil || out != "OK" {
		t.Fatalf("populate: %v %q", err, out)
	}
	used, _ := redisCLI(ctx, pid, "INFO", "memory")
	digest, err := redisCLI(ctx, pid, "DEBUG", "DIGEST")
	if err != nil {
		t.Fatal(err)
	}
	count, err := redisCLI(ctx, pid, "DBSIZE")
	if err != nil {
		t.Fatal(err)
	}
	if count != fmt.Sprint(keys) {
		t.Fatalf("DBSIZE %s before the move, want %d", count, keys)
	}
	for _, l := range strings.Split(used, "\n") {
		if strings.HasPrefix(l, "used_memory_human:") {
			t.Logf("redis %s, %s keys, digest %s", strings.TrimSpace(l), count, digest)
		}
	}

	margs := append([]string{"migrate", "--from", src.Socket, "--to", dst.Socket,
		"-n", node.Namespace, "--root", dst.CheckpointRoot, "--id", moved,
		"--work-dir", filepath.Join(src.Dir, "outgoing")}, migrateArgs...)
	out, err := exec.CommandContext(ctx, c.Berthctl(), append(margs, id)...).CombinedOutput()
	if err != nil {
		t.Fatalf("berthctl migrate: %v\n%s", err, out)
	}
	t.Logf("berthctl migrate:\n%s", out)
	dpid, st, err := dst.TaskPID(ctx, moved)
	if err != nil || st != "running" {
		t.Fatalf("restored redis on %s: status %q, %v", dst.Name, st, err)
	}
	count2, err := redisCLI(ctx, dpid, "DBSIZE")
	if err != nil {
		t.Fatal(err)
	}
	digest2, err := redisCLI(ctx, dpid, "DEBUG", "DIGEST")
	if err != nil {
		t.Fatal(err)
	}
	if count2 != count || digest2 != digest {
		t.Errorf("after the move: %s keys with digest %s; before: %s keys with digest %s", count2, digest2, count, digest)
	}
	if v, err := redisCLI(ctx, dpid, "GET", "key:4242"); err != nil || !strings.HasPrefix(v, "value:4242") {
		t.Errorf("GET key:4242 after the move = %q, %v", v, err)
	}
	if _, _, err := src.TaskPID(ctx, id); err == nil {
		t.Errorf("source task %s still exists after the move", id)
	}
}
