package commands

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/pelletier/go-toml/v2"
	"github.com/spf13/pflag"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
)

// The node configuration berthctl reads: the shim's (package shim documents every key), of which
// berthctl takes the trust keys and checkpoint_root only.
const (
	// DefaultConfig is the shim's configuration file, read when --config is not given and
	// $BERTH_SHIM_CONFIG is not set. A missing file at this default path means no keys.
	DefaultConfig = "/etc/berth/shim.toml"
	// EnvConfig names the shim's configuration file, as it does for the shim.
	EnvConfig = "BERTH_SHIM_CONFIG"
	// maxConfigBytes bounds the configuration file, in bytes.
	maxConfigBytes = 1 << 20
)

// nodeConfig is what berthctl reads of the shim's configuration: its trust section (at the top
// level, as the shim reads it, or in a [trust] table) and its checkpoint root. Other keys are
// ignored: berthctl does not link the shim and must not break on a key it does not know.
type nodeConfig struct {
	CheckpointRoot string `toml:"checkpoint_root"`
	signature.TrustConfig
	Trust *signature.TrustConfig `toml:"trust"`
}

// loadNodeConfig reads the configuration file path. A missing file is an error when explicit (the
// flag or the environment named it), and no keys otherwise. flag names the source in errors.
func loadNodeConfig(path, flag string, explicit bool) (nodeConfig, error) {
	var c nodeConfig
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) && !explicit {
		return c, nil
	}
	if err != nil {
		return c, fmt.Errorf("%s: %w", flag, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConfigBytes+1))
	if err != nil {
		return c, fmt.Errorf("%s %s: %w", flag, path, err)
	}
	if len(b) > maxConfigBytes {
		return c, fmt.Errorf("%s %s: larger than %d bytes", flag, path, maxConfigBytes)
	}
	if err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c); err != nil {
		return c, fmt.Errorf("%s %s: %w", flag, path, err)
	}
	if c.Trust != nil {
		top := c.TrustConfig
		if top.SigningKey != "" || len(top.TrustedKeys) > 0 || top.AllowUnsigned {
			return c, fmt.Errorf("%s %s: the trust keys are both at the top level and in [trust]: keep one", flag, path)
		}
		c.TrustConfig = *c.Trust
	}
	if c.CheckpointRoot != "" && !filepath.IsAbs(c.CheckpointRoot) {
		return c, fmt.Errorf("%s %s: checkpoint_root %q: must be an absolute path", flag, path, c.CheckpointRoot)
	}
	if err := c.TrustConfig.Validate(); err != nil {
		return c, fmt.Errorf("%s %s: %w", flag, path, err)
	}
	return c, nil
}

// config reads the node configuration that --config (or $BERTH_SHIM_CONFIG) names.
func (g *Globals) config() (nodeConfig, error) {
	flag, explicit := "--config", true
	switch {
	case g.flags != nil && g.flags.Changed("config"):
	case g.configFromEnv:
		flag = "$" + EnvConfig
	default:
		explicit = false
	}
	return loadNodeConfig(g.Config, flag+" "+g.Config, explicit)
}

// checkpointRoot returns root when the command's --root was given, else the configuration's
// checkpoint_root, else checkpoint.DefaultRoot.
func (g *Globals) checkpointRoot(fs *pflag.FlagSet, root string) (string, error) {
	if fs.Changed("root") || fs.Changed("to-root") {
		return root, nil
	}
	c, err := g.config()
	if err != nil {
		return "", err
	}
	if c.CheckpointRoot != "" {
		return c.CheckpointRoot, nil
	}
	return checkpoint.DefaultRoot, nil
}

// trustFlags override the configuration's trust keys for one command: the key to sign with, more
// keys to trust, and the opt-out.
type trustFlags struct {
	signingKey    string
	trusted       []string
	allowUnsigned bool
	sign, verify  bool // what the command does: which flags it has
	// verifyOnly drops the configuration's signing_key: the command never reads the private key
	// (so it runs where the key is not mounted, the node agent), and the node's own key is then
	// trusted only when trusted_keys (or --trusted-key) lists its public key. For receive.
	verifyOnly bool
}

// addTrustFlags registers the trust flags of a command that signs (sign), verifies (verify) or
// both.
func addTrustFlags(fs *pflag.FlagSet, sign, verify bool) *trustFlags {
	t := &trustFlags{sign: sign, verify: verify}
	if sign {
		fs.StringVar(&t.signingKey, "signing-key", "", "private key (PEM, mode 0600) to sign checkpoints with (default: signing_key of --config)")
	}
	if verify {
		fs.StringArrayVar(&t.trusted, "trusted-key", nil, "public key (PEM) to trust besides trusted_keys of --config, for every namespace (repeatable)")
		fs.BoolVar(&t.allowUnsigned, "allow-unsigned", false, "accept unsigned checkpoints and unknown signers, with a warning (allow_unsigned of --config; labs only)")
	}
	return t
}

// policy loads the trust policy: the configuration's keys, overridden by the flags (without the
// configuration's signing_key when verifyOnly). Errors name the flag or the configuration file.
func (t *trustFlags) policy(g *Globals) (*signature.Policy, error) {
	c, err := g.config()
	if err != nil {
		return nil, err
	}
	tc := c.TrustConfig
	if t.verifyOnly {
		tc.SigningKey = ""
	}
	if t.signingKey != "" {
		abs, err := filepath.Abs(t.signingKey)
		if err != nil {
			return nil, fmt.Errorf("--signing-key: %w", err)
		}
		tc.SigningKey = abs
	}
	for _, k := range t.trusted {
		abs, err := filepath.Abs(k)
		if err != nil {
			return nil, fmt.Errorf("--trusted-key: %w", err)
		}
		tc.TrustedKeys = append(tc.TrustedKeys, signature.TrustedKey{Path: abs})
	}
	tc.AllowUnsigned = tc.AllowUnsigned || t.allowUnsigned
	if tc.SigningKey != "" && t.signingKey == "" {
		// the node's key, made on first use as the shim makes it (a fresh node signs with a
		// key it generated and trusts itself); a --signing-key must exist
		if _, err := signature.EnsureKey(tc.SigningKey); err != nil {
			return nil, fmt.Errorf("trust policy (--config %s): signing_key: %w", g.Config, err)
		}
	}
	p, err := signature.LoadPolicy(tc)
	if err != nil {
		return nil, fmt.Errorf("trust policy (--config %s and the trust flags): %w", g.Config, err)
	}
	return p, nil
}

// errNoSigningKey: a command that writes a checkpoint has no key to sign it with.
var errNoSigningKey = errors.New("no signing key")

// checkSigner returns an error when p has no signing key and does not allow unsigned checkpoints:
// what the command would write would be refused by every node. what names the checkpoint for
// the message. With allow_unsigned it warns on warn instead.
func checkSigner(p *signature.Policy, g *Globals, what string, warn io.Writer) error {
	if p.Signer != nil {
		return nil
	}
	if p.AllowUnsigned {
		fmt.Fprintf(warn, "berthctl: warning: %s will be unsigned (no signing key; allow_unsigned is set): only nodes that allow unsigned checkpoints restore it\n", what)
		return nil
	}
	return fmt.Errorf("%w for %s: set signing_key in %s (--config) or give --signing-key; every node refuses unsigned checkpoints unless it sets allow_unsigned",
		errNoSigningKey, what, g.Config)
}

// verifyCheckpoint checks dir against p: its berth.sig must be a trusted key's signature of its
// berth.json (which lists every file's digest). It returns the signing key's id, "" when the
// checkpoint passes only thanks to allow_unsigned, which is then reported on warn, every time.
func verifyCheckpoint(ctx context.Context, p *signature.Policy, dir string, warn io.Writer) (string, error) {
	v, err := p.Verify(ctx, dir, kubernetesNamespace(dir))
	if err != nil {
		return "", err
	}
	if v.Warning != nil {
		fmt.Fprintf(warn, "berthctl: warning: accepted only because allow_unsigned is set: %v\n", v.Warning)
	}
	return v.KeyID, nil
}

// kubernetesNamespace returns the Kubernetes namespace the checkpoint in dir records (its
// berth.json, else the shim's checkpoint/berth.json), for the keys trusted only for some
// namespaces; "" when it records none or cannot be read, which admits only keys trusted for every
// namespace. Reading it before the signature is checked is sound: Verify then requires that very
// berth.json to be what a key trusted for that namespace signed. The shim verifies again at
// restore, against the namespace of the pod that restores it.
func kubernetesNamespace(dir string) string {
	for _, d := range []string{dir, filepath.Join(dir, checkpoint.ImagesDir)} {
		if m, err := checkpoint.ReadManifest(d); err == nil && m.Container.KubernetesNamespace != "" {
			return m.Container.KubernetesNamespace
		}
	}
	return ""
}
