// Package sockopt sets and reads the socket options the node proxy needs: the original
// destination of a redirected connection (SO_ORIGINAL_DST), packet marks (SO_MARK), port
// reuse (SO_REUSEPORT) and a UDP socket's leaving of its group (StopDelivery), transparent
// sockets (IP_TRANSPARENT), a datagram's destination address and the source of the answer
// (IP_PKTINFO), reading what a UDP socket has queued without waiting (ReadQueued), TCP
// keepalive and the open-file limit.
//
// The Linux implementations live in *_linux.go; elsewhere the Linux-only options return an
// error wrapping errors.ErrUnsupported so the module still builds and runs (without
// redirection) on other systems. It does not create sockets or install iptables rules.
package sockopt

import (
	"fmt"
	"net"
	"time"
)

// SetKeepalive turns TCP keepalive on with ztunnel's knobs: first probe after idle, then
// every interval, giving up after count probes. Zero values keep the system defaults and a
// negative value leaves that knob unchanged, as net.KeepAliveConfig documents.
func SetKeepalive(c *net.TCPConn, idle, interval time.Duration, count int) error {
	if err := c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: idle, Interval: interval, Count: count}); err != nil {
		return fmt.Errorf("sockopt: keepalive: %w", err)
	}
	return nil
}
