package plugin

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// recordKeyBytes is the size of the key that authenticates placement records, in bytes.
const recordKeyBytes = 32

// loadRecordKey returns the record key in path, creating it (recordKeyBytes random bytes, mode
// 0600, its directory 0700) when it does not exist; "" returns a fresh key kept in memory only.
// A key file that is not a regular file of exactly recordKeyBytes bytes, or that other users
// may read or write, is refused: whoever holds it can write records berth-nri believes.
func loadRecordKey(path string) ([]byte, error) {
	if path == "" {
		return newRecordKey()
	}
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return createRecordKey(path)
	}
	if err != nil {
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o077 != 0 || fi.Size() != recordKeyBytes {
		return nil, fmt.Errorf("record_key_file %s: want a regular file of %d bytes that only its owner may read (mode 0600); it is %v, %d bytes (remove it: berth-nri makes a new one, and re-books the containers of its earlier records from what they hold)",
			path, recordKeyBytes, fi.Mode(), fi.Size())
	}
	key, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	if len(key) != recordKeyBytes {
		return nil, fmt.Errorf("record_key_file %s: %d bytes, want %d", path, len(key), recordKeyBytes)
	}
	return key, nil
}

func newRecordKey() ([]byte, error) {
	key := make([]byte, recordKeyBytes)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("record key: %w", err)
	}
	return key, nil
}

// createRecordKey writes a new key to path without replacing one another process made meanwhile.
func createRecordKey(path string) ([]byte, error) {
	key, err := newRecordKey()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return loadRecordKey(path)
	}
	if err != nil {
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	if _, err := f.Write(key); err != nil {
		f.Close()
		os.Remove(path)
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("record_key_file: %w", err)
	}
	return key, nil
}
