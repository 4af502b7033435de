//go:build !linux

package bench

import (
	"context"
	"errors"
	"net"
)

// NetnsDialer opens sockets from inside a network namespace; only Linux has them.
type NetnsDialer struct{}

var errNoNetns = errors.New("bench: network namespaces need Linux")

// NewNetnsDialer fails: network namespaces need Linux.
func NewNetnsDialer(name string) (*NetnsDialer, error) { return nil, errNoNetns }

// DialContext fails: network namespaces need Linux.
func (*NetnsDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return nil, errNoNetns
}

// Listen fails: network namespaces need Linux.
func (*NetnsDialer) Listen(network, addr string) (net.Listener, error) { return nil, errNoNetns }

// Close does nothing.
func (*NetnsDialer) Close() error { return nil }
