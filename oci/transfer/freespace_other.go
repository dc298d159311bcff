//go:build !linux

package transfer

import "errors"

// statfsFree reports errors.ErrUnsupported off Linux: the receiver then does not check free
// space unless Receiver.FreeBytes is set.
func statfsFree(string) (uint64, error) { return 0, errors.ErrUnsupported }
