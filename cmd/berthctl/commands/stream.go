package commands

import (
	"context"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/transfer"
)

// Move modes of `berthctl migrate --mode`.
const (
	modeCopy   = "copy"
	modeLazy   = "lazy"
	modeStored = "stored"
)

// pageRelay returns move.MigrateOptions.Pages for the receiver at addr: each page stream gets
// its own connection to the receiver (mutual TLS with t's files, as the checkpoint's).
func pageRelay(addr string, t *tlsFlags) func(ctx context.Context, name string) (move.PageRelay, error) {
	return func(ctx context.Context, name string) (move.PageRelay, error) {
		conn, err := dialReceiver(ctx, addr, t)
		if err != nil {
			return nil, err
		}
		relay, err := transfer.StartPageRelay(ctx, conn, name)
		if err != nil {
			conn.Close()
			return nil, err
		}
		return relay, nil
	}
}

// lazyRelay returns move.MigrateOptions.Lazy for the receiver at addr: each lazy page stream
// gets its own connection to the receiver (mutual TLS with t's files, as the checkpoint's),
// dialed before anything is paused; the receiver refuses there when it cannot restore lazily.
func lazyRelay(addr string, t *tlsFlags) func(ctx context.Context, name string) (move.LazyRelay, error) {
	return func(ctx context.Context, name string) (move.LazyRelay, error) {
		conn, err := dialReceiver(ctx, addr, t)
		if err != nil {
			return nil, err
		}
		relay, err := transfer.StartLazyRelay(ctx, conn, name)
		if err != nil {
			conn.Close()
			return nil, err
		}
		return relay, nil
	}
}
