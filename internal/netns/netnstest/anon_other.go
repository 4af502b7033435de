//go:build !linux

package netnstest

import (
	"testing"

	"github.com/gozt/gozt/internal/netns"
)

// NewAnonymous skips t: network namespaces need Linux.
func NewAnonymous(t testing.TB) *netns.NetNS {
	t.Helper()
	t.Skip("netns: network namespaces need Linux")
	return nil
}
