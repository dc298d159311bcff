package commands

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/spf13/pflag"
)

// The global flags' defaults, as ctr's: containerd's socket and namespace, unless the
// environment names others.
const (
	DefaultAddress   = "/run/containerd/containerd.sock"
	DefaultNamespace = "default"
	// EnvAddress and EnvNamespace are read when -a/--address and -n/--namespace are not given.
	EnvAddress   = "CONTAINERD_ADDRESS"
	EnvNamespace = "CONTAINERD_NAMESPACE"
)

// Globals are the flags every berthctl command accepts, as ctr's: which containerd (its socket)
// and which namespace. Commands that talk to containerd read them when they run.
type Globals struct {
	// Address is containerd's socket path; Namespace the containerd namespace.
	Address, Namespace string
	// Config is the node's configuration file (the shim's): the trust keys and checkpoint_root.
	Config string
	// fromEnv records which of them came from the environment, for error messages.
	addressFromEnv, namespaceFromEnv, configFromEnv bool
	flags                                           *pflag.FlagSet
}

// AddFlags registers -a/--address, -n/--namespace and --config on fs (the root's persistent
// flags). Their defaults are $CONTAINERD_ADDRESS, $CONTAINERD_NAMESPACE and $BERTH_SHIM_CONFIG,
// read with getenv, when set.
func (g *Globals) AddFlags(fs *pflag.FlagSet, getenv func(string) string) {
	g.flags = fs
	addr, ns, cfg := getenv(EnvAddress), getenv(EnvNamespace), getenv(EnvConfig)
	g.addressFromEnv, g.namespaceFromEnv, g.configFromEnv = addr != "", ns != "", cfg != ""
	if cfg == "" {
		cfg = DefaultConfig
	}
	fs.StringVar(&g.Config, "config", cfg, "the node's berth configuration (the shim's TOML): signing key, trusted keys, checkpoint root ($"+EnvConfig+")")
	if addr == "" {
		addr = DefaultAddress
	}
	if ns == "" {
		ns = DefaultNamespace
	}
	fs.StringVarP(&g.Address, "address", "a", addr, "containerd socket ($"+EnvAddress+")")
	fs.StringVarP(&g.Namespace, "namespace", "n", ns, "containerd namespace ($"+EnvNamespace+")")
}

// addressFlag names where Address came from: the flag or the environment variable.
func (g *Globals) addressFlag() string {
	if g.addressFromEnv && (g.flags == nil || !g.flags.Changed("address")) {
		return "$" + EnvAddress
	}
	return "--address"
}

// namespace returns the namespace, checked as containerd checks it, with an error naming the
// flag or environment variable it came from.
func (g *Globals) namespace() (string, error) {
	if err := identifiers.Validate(g.Namespace); err != nil {
		from := "--namespace"
		if g.namespaceFromEnv && (g.flags == nil || !g.flags.Changed("namespace")) {
			from = "$" + EnvNamespace
		}
		return "", fmt.Errorf("%s %q: %w", from, g.Namespace, err)
	}
	return g.Namespace, nil
}

// connect returns a client of the containerd at the socket path addr, after checking that the
// socket exists and that containerd answers (containerd.New alone does not connect). Errors name
// flag, the flag (or variable) addr came from, and role ("source", "destination").
func connect(ctx context.Context, flag, role, addr string) (*containerd.Client, error) {
	if _, err := os.Stat(addr); err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("%s %s: %s containerd socket: %w", flag, addr, role, err)
	}
	c, err := containerd.New(addr, containerd.WithTimeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %s containerd: %w", flag, addr, role, err)
	}
	if _, err := c.Version(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("%s %s: %s containerd does not answer: %w", flag, addr, role, err)
	}
	return c, nil
}
