//go:build !linux

package podpoll

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
)

// Poller needs epoll: elsewhere New fails.
type Poller struct{}

// New fails with errors.ErrUnsupported outside Linux.
func New() (*Poller, error) { return nil, errors.ErrUnsupported }

func (p *Poller) Close() error { return nil }

func (p *Poller) Watch(net.Listener, func(net.Conn, error)) (func(), error) {
	return nil, errors.ErrUnsupported
}

func (p *Poller) WatchPacket(net.PacketConn, func([]byte, netip.AddrPort, netip.Addr, error)) (func(), error) {
	return nil, errors.ErrUnsupported
}

func (p *Poller) WatchReadable(syscall.Conn, func()) (func() bool, error) {
	return nil, errors.ErrUnsupported
}
