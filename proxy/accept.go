package proxy

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/gozt/gozt/internal/backoff"
)

// goAcceptor accepts on a goroutine per listener: the Acceptor of a proxy whose Config
// names none (every mode but in-pod's pod proxies).
type goAcceptor struct{}

var _ Acceptor = goAcceptor{}

// Watch starts ln's accept loop. stop closes ln, the only way to end a blocked Accept,
// and returns once the loop has.
func (goAcceptor) Watch(ln net.Listener, accepted func(net.Conn, error)) (stop func(), err error) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { acceptLoop(ln, accepted, done) })
	return sync.OnceFunc(func() {
		close(done)
		ln.Close()
		wg.Wait()
	}), nil
}

// acceptLoop hands accepted every connection ln accepts, and every failed accept, backing
// off (5 ms doubling to 1 s) while accepts fail, until done is closed or ln is. A
// connection accepted as done closes is handed over still: the kernel gave it to this
// listener, and none other will see it.
func acceptLoop(ln net.Listener, accepted func(net.Conn, error), done <-chan struct{}) {
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err == nil {
			delay = 0
			accepted(c, nil)
			continue
		}
		select {
		case <-done:
			return
		default:
		}
		if errors.Is(err, net.ErrClosed) {
			return
		}
		// Out of file descriptors and the like: back off rather than spin.
		accepted(nil, err)
		delay = backoff.Next(delay)
		if !backoff.Wait(delay, done) {
			return
		}
	}
}
