package netpoll

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/gozt/gozt/internal/sockopt"
)

// PerSocket waits on each watched socket with a goroutine of its own, blocked in Accept
// or in a read. Its zero value is ready; it holds no state, and Close does nothing.
//
// A stop ends the blocked call with a past deadline, not by closing the socket (a DNS
// proxy answers the queries it took from a UDP socket it still holds), and clears the
// deadline once the goroutine has returned. A listener without SetDeadline (hbone's
// AdmitListener, whose Accept also waits for room) is ended only by its owner's Close:
// the owner closes it before stop, as a proxy does.
type PerSocket struct{}

var _ Poller = PerSocket{}

// Watch starts ln's accept loop.
func (PerSocket) Watch(ln net.Listener, accepted func(net.Conn, error)) (stop func(), err error) {
	var setDeadline func(time.Time) error
	if d, ok := ln.(interface{ SetDeadline(time.Time) error }); ok {
		setDeadline = d.SetDeadline
	}
	return goWatch(setDeadline, func() error {
		c, err := ln.Accept()
		if err == nil {
			accepted(c, nil)
		}
		return err
	}, func(err error) { accepted(nil, err) }), nil
}

// WatchPacket starts pc's read loop, with a read buffer of its own.
func (PerSocket) WatchPacket(pc net.PacketConn, read func(b []byte, from netip.AddrPort, to netip.Addr, err error)) (stop func(), err error) {
	uc, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, fmt.Errorf("netpoll: watch: %T is not a *net.UDPConn", pc)
	}
	buf, oob := make([]byte, maxDatagram), make([]byte, sockopt.DstOOBSize)
	return goWatch(uc.SetReadDeadline, func() error {
		n, oobn, _, from, err := uc.ReadMsgUDPAddrPort(buf, oob)
		if err == nil {
			read(buf[:n], from, sockopt.ParseDst(oob[:oobn]), nil)
		}
		return err
	}, func(err error) { read(nil, netip.AddrPort{}, netip.Addr{}, err) }), nil
}

// WatchReadable fails: waiting for readability would take a goroutine per socket, the
// one a caller meant to give up.
func (PerSocket) WatchReadable(Readable) (uint64, error) {
	return 0, fmt.Errorf("netpoll: watch readable: %w", errors.ErrUnsupported)
}

// CancelReadable has no watch to end.
func (PerSocket) CancelReadable(uint64) bool { return false }

// Parks is false: see WatchReadable.
func (PerSocket) Parks() bool { return false }

// Close does nothing: every watch has a stop of its own.
func (PerSocket) Close() error { return nil }

// aLongTimeAgo is a deadline in the past: it ends a blocked call at once.
var aLongTimeAgo = time.Unix(1, 0)

// goWatch runs next, which accepts or reads once and hands over what it got, on a
// goroutine until stop. stop sets a past deadline (when setDeadline is not nil), which
// ends a next that is blocked or about to block, and returns once the goroutine has: an
// accept or read that won the race is still handed over first, as the Poller contract
// allows until stop returns.
func goWatch(setDeadline func(time.Time) error, next func() error, failed func(error)) (stop func()) {
	stopping := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { watchLoop(next, failed, stopping) })
	return sync.OnceFunc(func() {
		close(stopping)
		if setDeadline != nil {
			setDeadline(aLongTimeAgo)
		}
		wg.Wait()
		if setDeadline != nil {
			setDeadline(time.Time{}) // the socket as the owner left it
		}
	})
}

// watchLoop calls next until stopping is closed or the socket is. A failure is handed to
// failed and retried after a delay (nextDelay) rather than at once.
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
		delay = nextDelay(delay)
		if !waitDelay(delay, stopping) {
			return
		}
	}
}
