package main

import (
	"context"
	"fmt"
	"os"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
)

// connect returns a client of the containerd at the socket path addr, after checking that the
// socket exists and that containerd answers (containerd.New alone does not connect).
func connect(ctx context.Context, role, addr string) (*containerd.Client, error) {
	if _, err := os.Stat(addr); err != nil {
		return nil, fmt.Errorf("%s containerd socket: %w", role, err)
	}
	c, err := containerd.New(addr, containerd.WithTimeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("%s containerd %s: %w", role, addr, err)
	}
	if _, err := c.Version(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("%s containerd %s does not answer: %w", role, addr, err)
	}
	return c, nil
}
