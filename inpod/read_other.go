//go:build !linux

package inpod

import (
	"errors"
	"fmt"
	"net"

	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/netns"
)

// readRequest fails: receiving a pod's netns needs Linux.
func readRequest(c *net.UnixConn, buf *[maxMessage]byte) (*zdspb.WorkloadRequest, *netns.NetNS, error) {
	return nil, nil, fmt.Errorf("inpod: in-pod mode needs Linux: %w", errors.ErrUnsupported)
}
