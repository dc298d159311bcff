package fakecuda_test

import "fmt"

func fmtSscanf(line string, lo, hi *uintptr) (int, error) {
	return fmt.Sscanf(line, "%x-%x", lo, hi)
}
