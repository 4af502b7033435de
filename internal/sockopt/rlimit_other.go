//go:build !unix

package sockopt

import (
	"errors"
	"fmt"
)

// RaiseFileLimit has no meaning without RLIMIT_NOFILE.
func RaiseFileLimit() (uint64, error) {
	return 0, fmt.Errorf("sockopt: raise RLIMIT_NOFILE: %w", errors.ErrUnsupported)
}
