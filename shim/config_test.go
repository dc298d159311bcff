package shim_test

import (
	"bufio"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/shim"
)

// contribConfig is the shim configuration berth ships: it documents every key, with its default.
const contribConfig = "../contrib/berth-shim.toml"

// TestContribConfigIsTheDefault: contrib/berth-shim.toml decodes strictly into Config (LoadConfig
// refuses unknown keys) and states exactly the defaults.
func TestContribConfigIsTheDefault(t *testing.T) {
	if _, err := os.Stat(contribConfig); err != nil {
		t.Fatal(err) // LoadConfig takes a missing file for the defaults: it must be there
	}
	got, err := shim.LoadConfig(contribConfig)
	if err != nil {
		t.Fatal(err)
	}
	want := shim.DefaultConfig()
	want.Path = contribConfig
	// [] in the file, nil by default
	for _, l := range []*[]string{&got.NamespaceMappings, &got.AllowedRegistries, &got.RegistryPlainHTTP} {
		if *l != nil && len(*l) == 0 {
			*l = nil
		}
	}
	if got.TrustedKeys != nil && len(got.TrustedKeys) == 0 {
		got.TrustedKeys = nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%s = %+v\ndefaults = %+v", contribConfig, got, want)
	}
}

// TestContribConfigDocumentsEveryKey: every key of Config is set in contrib/berth-shim.toml,
// under a comment that says what it does.
func TestContribConfigDocumentsEveryKey(t *testing.T) {
	documented := documentedKeys(t, contribConfig)
	var check func(typ reflect.Type)
	check = func(typ reflect.Type) {
		for i := range typ.NumField() {
			f := typ.Field(i)
			if f.Anonymous { // embedded: its keys are the config's own (signature.TrustConfig)
				check(f.Type)
				continue
			}
			key, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
			if key == "" || key == "-" {
				continue
			}
			if !documented[key] {
				t.Errorf("%s: key %s (Config.%s) is not set under a comment", contribConfig, key, f.Name)
			}
		}
	}
	check(reflect.TypeFor[shim.Config]())
}

var keyLine = regexp.MustCompile(`^([a-z0-9_]+)\s*=`)

// documentedKeys returns the keys that path sets at top level whose block (the lines above, up to
// a blank line) holds a comment.
func documentedKeys(t *testing.T, path string) map[string]bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	keys := map[string]bool{}
	commented := false // the current block of non-blank lines has a comment so far
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
			commented = false
		case strings.HasPrefix(line, "#"):
			commented = true
		case strings.HasPrefix(line, "["):
			t.Fatalf("%s: table %s: the shim's config has no tables", path, line)
		default:
			if m := keyLine.FindStringSubmatch(line); m != nil {
				keys[m[1]] = commented
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return keys
}

// TestRealDepsGeneratesNodeKey (issue 20): a node whose signing key does not exist yet makes one
// (0600, its public key beside it) and trusts it, so that its own checkpoints restore on it with
// no configuration; an existing key is kept.
func TestRealDepsGeneratesNodeKey(t *testing.T) {
	cfg := shim.DefaultConfig()
	if cfg.SigningKey != signature.DefaultSigningKey {
		t.Fatalf("default signing_key %q, want %q", cfg.SigningKey, signature.DefaultSigningKey)
	}
	cfg.SigningKey = filepath.Join(t.TempDir(), "berth", "node.key")
	deps, err := shim.RealDeps(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if deps.Trust.Signer == nil {
		t.Fatal("no signer")
	}
	if fi, err := os.Stat(cfg.SigningKey); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("generated key: %v %v", fi, err)
	}
	if _, err := os.Stat(signature.PublicKeyPath(cfg.SigningKey)); err != nil {
		t.Errorf("public key: %v", err)
	}
	if !deps.Trust.TrustedFor(deps.Trust.Signer.ID, "") || !deps.Trust.TrustedFor(deps.Trust.Signer.ID, "team-a") {
		t.Error("the node does not trust its own key")
	}
	again, err := shim.RealDeps(cfg)
	if err != nil || again.Trust.Signer.ID != deps.Trust.Signer.ID {
		t.Errorf("a second shim: %v, key %v", err, again.Trust.Signer)
	}
}
