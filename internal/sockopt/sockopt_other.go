//go:build !linux

package sockopt

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"time"
)

// OriginalDst needs Linux netfilter; elsewhere it always fails (callers fall back to the
// local address).
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	return netip.AddrPort{}, fmt.Errorf("sockopt: original destination: %w", errors.ErrUnsupported)
}

// SetMark is Linux-only.
func SetMark(c syscall.RawConn, mark uint32) error {
	return fmt.Errorf("sockopt: set SO_MARK: %w", errors.ErrUnsupported)
}

// SetReusePort is Linux-only here.
func SetReusePort(c syscall.RawConn) error {
	return fmt.Errorf("sockopt: set SO_REUSEPORT: %w", errors.ErrUnsupported)
}

// SetTransparent is Linux-only.
func SetTransparent(c syscall.RawConn, v6 bool) error {
	return fmt.Errorf("sockopt: set IP_TRANSPARENT: %w", errors.ErrUnsupported)
}

// Control returns a Control function that fails if a mark is asked for, and does nothing for
// mark 0, so dialers without a mark work everywhere.
func Control(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		if mark == 0 {
			return nil
		}
		return SetMark(c, mark)
	}
}

// SetUserTimeout is Linux-only.
func SetUserTimeout(c *net.TCPConn, d time.Duration) error {
	return fmt.Errorf("sockopt: set TCP_USER_TIMEOUT: %w", errors.ErrUnsupported)
}

// SetRecvDst is Linux-only here: elsewhere a wildcard socket answers from the address the
// kernel picks.
func SetRecvDst(c syscall.RawConn) error {
	return fmt.Errorf("sockopt: set IP_PKTINFO: %w", errors.ErrUnsupported)
}

// DstOOBSize is 0: without SetRecvDst there is no control message to read.
const DstOOBSize = 0

// ParseDst finds nothing without SetRecvDst.
func ParseDst(oob []byte) netip.Addr { return netip.Addr{} }

// SrcOOB returns nil: the kernel picks the source.
func SrcOOB(src netip.Addr) []byte { return nil }

// StopDelivery is Linux-only here.
func StopDelivery(ucs ...*net.UDPConn) error {
	return fmt.Errorf("sockopt: stop delivery: %w", errors.ErrUnsupported)
}

// ReadQueued is Linux-only here.
func ReadQueued(rc syscall.RawConn, buf, oob []byte, max int, read func(b []byte, from netip.AddrPort, to netip.Addr)) (int, error) {
	return 0, fmt.Errorf("sockopt: read queued: %w", errors.ErrUnsupported)
}
