package dns

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/gozt/gozt/internal/backoff"
	"github.com/gozt/gozt/internal/sockopt"
)

// udpReadSize is the read buffer each goPoller packet socket holds: 4 KiB, RFC 6891's
// recommended largest EDNS payload and hickory's receive buffer (the Rust ztunnel's). A
// longer query is cut to it and answered FORMERR, as miekg/dns's server did with this size.
const udpReadSize = 4096

// goPoller waits on each socket with a goroutine of its own: the Poller of a Server whose
// Config names none (every mode but in-pod's). A stop ends the blocked read or accept with a
// past deadline rather than by closing the socket: Serve closes the sockets itself, once the
// queries in flight are answered, and UDP answers leave by the socket they came in on.
type goPoller struct{}

var _ Poller = goPoller{}

// Watch starts ln's accept loop. ln must have SetDeadline (a *net.TCPListener has).
func (goPoller) Watch(ln net.Listener, accepted func(net.Conn, error)) (stop func(), err error) {
	dl, ok := ln.(interface{ SetDeadline(time.Time) error })
	if !ok {
		return nil, fmt.Errorf("dns: watch: %T has no SetDeadline", ln)
	}
	return goWatch(dl.SetDeadline, func() error {
		c, err := ln.Accept()
		if err == nil {
			accepted(c, nil)
		}
		return err
	}, func(err error) { accepted(nil, err) }), nil
}

// WatchPacket starts pc's read loop. pc must be a *net.UDPConn.
func (goPoller) WatchPacket(pc net.PacketConn, read func(b []byte, from netip.AddrPort, to netip.Addr, err error)) (stop func(), err error) {
	uc, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, fmt.Errorf("dns: watch: %T is not a *net.UDPConn", pc)
	}
	buf, oob := make([]byte, udpReadSize), make([]byte, sockopt.DstOOBSize)
	return goWatch(uc.SetReadDeadline, func() error {
		n, oobn, _, from, err := uc.ReadMsgUDPAddrPort(buf, oob)
		if err == nil {
			read(buf[:n], from, sockopt.ParseDst(oob[:oobn]), nil)
		}
		return err
	}, func(err error) { read(nil, netip.AddrPort{}, netip.Addr{}, err) }), nil
}

// goWatch runs next, which reads or accepts once and hands over what it got, on a goroutine
// until stop. stop sets a past deadline, which ends a next that is blocked or about to
// block, and returns once the goroutine has: a read or accept that won the race is still
// handed over first, as the Poller contract allows until stop returns.
func goWatch(setDeadline func(time.Time) error, next func() error, failed func(error)) (stop func()) {
	stopping := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { watchLoop(next, failed, stopping) })
	return sync.OnceFunc(func() {
		close(stopping)
		setDeadline(time.Unix(1, 0))
		wg.Wait()
	})
}

// watchLoop calls next until stopping is closed or the socket is. A failure (out of file
// descriptors, say) is handed to failed and retried after a delay (internal/backoff), as
// podpoll does, rather than spinning.
func watchLoop(next func() error, failed func(error), stopping <-chan struct{}) {
	var delay time.Duration
	for {
		err := next()
		if err == nil {
			delay = 0
			continue
		}
		select {
		case <-stopping:
			return
		default:
		}
		if errors.Is(err, net.ErrClosed) {
			return
		}
		failed(err)
		delay = backoff.Next(delay)
		if !backoff.Wait(delay, stopping) {
			return
		}
	}
}
