// Package attack is attack traffic for tests and benchmarks, and what they measure of the
// honest client beside it (victim.go). The attacks are peers with a mesh certificate that
// flood an HBONE server with HTTP/2 frames (CONNECTs, resets, PINGs, SETTINGS, empty
// DATA) or with TLS handshakes, and peers that hold TCP connections open before or inside
// the handshake; each sends only to the address it is given and stops when told. Nothing
// in the node links this package.
package attack

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// A Flood is what one hostile HTTP/2 connection sends on its i'th turn (i = 0, 1, ...).
type Flood func(w *Writer, i int) error

// Writer writes frames on one flooding connection; the reader (H2Flood's read) answers the
// server's PINGs and SETTINGS through it too.
type Writer struct {
	mu   sync.Mutex // guards fr's writes, enc and hbuf
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer
}

func (w *Writer) write(f func(fr *http2.Framer) error) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return f(w.fr)
}

// connect sends HEADERS opening stream id as a CONNECT to dst.
func (w *Writer) connect(id uint32, dst string) error {
	return w.write(func(fr *http2.Framer) error {
		w.hbuf.Reset()
		w.enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		w.enc.WriteField(hpack.HeaderField{Name: ":authority", Value: dst})
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: w.hbuf.Bytes(), EndHeaders: true})
	})
}

// Connects opens a new CONNECT stream to dst each turn, reset at once (RST_STREAM(CANCEL))
// if reset.
func Connects(dst string, reset bool) Flood {
	return func(w *Writer, i int) error {
		id := uint32(2*i + 1)
		if err := w.connect(id, dst); err != nil || !reset {
			return err
		}
		return w.write(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeCancel) })
	}
}

// Pings sends a PING each turn.
func Pings(w *Writer, i int) error {
	return w.write(func(fr *http2.Framer) error { return fr.WritePing(false, [8]byte{byte(i)}) })
}

// Settings sends an empty SETTINGS frame each turn.
func Settings(w *Writer, _ int) error {
	return w.write(func(fr *http2.Framer) error { return fr.WriteSettings() })
}

// EmptyData opens one CONNECT stream to dst and sends an empty DATA frame on it each turn.
func EmptyData(dst string) Flood {
	return func(w *Writer, i int) error {
		if i == 0 {
			if err := w.connect(1, dst); err != nil {
				return err
			}
		}
		return w.write(func(fr *http2.Framer) error { return fr.WriteData(1, false, nil) })
	}
}

// H2Flood keeps one mTLS HTTP/2 connection to addr sending flood's turns, one per every
// (0: as fast as it can). With read it reads the server's frames, answering its PINGs
// and SETTINGS as a client does; without, it never reads. When the server closes the
// connection it opens another, until stop is closed. ops counts the turns sent.
func H2Flood(addr string, cfg *tls.Config, flood Flood, every time.Duration, read bool, stop <-chan struct{}, ops *atomic.Int64) {
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
		floodConn(ctx, tc, flood, every, read, ops)
		tc.Close()
	}
}

// floodConn sends flood's turns on one connection until a write fails or ctx ends.
func floodConn(ctx context.Context, tc net.Conn, flood Flood, every time.Duration, read bool, ops *atomic.Int64) {
	defer context.AfterFunc(ctx, func() { tc.Close() })()
	w := &Writer{fr: http2.NewFramer(tc, tc)}
	w.enc = hpack.NewEncoder(&w.hbuf)
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil || w.fr.WriteSettings() != nil {
		return
	}
	if read {
		var wg sync.WaitGroup
		wg.Go(func() { answer(w, &wg) })
		defer func() { tc.Close(); wg.Wait() }()
	}
	next := time.Now()
	for i := 0; i < 1<<30; i++ {
		if every > 0 {
			next = next.Add(every)
			time.Sleep(time.Until(next))
		}
		if flood(w, i) != nil {
			return
		}
		ops.Add(1)
	}
}

// answer reads w's connection until it fails, acknowledging the server's PINGs and
// SETTINGS in goroutines of wg's (a reader that waited on a write could stall both ends).
func answer(w *Writer, wg *sync.WaitGroup) {
	w.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := w.fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.PingFrame:
			if data := f.Data; !f.IsAck() {
				wg.Go(func() { w.write(func(fr *http2.Framer) error { return fr.WritePing(true, data) }) })
			}
		case *http2.SettingsFrame:
			if !f.IsAck() {
				wg.Go(func() { w.write((*http2.Framer).WriteSettingsAck) })
			}
		}
	}
}

// Handshakes completes TLS handshakes with addr presenting cfg's certificate, closing
// each connection at once, until stop is closed. ops counts the connections; a handshake
// the server refuses counts too (refusing is the work).
func Handshakes(addr string, cfg *tls.Config, stop <-chan struct{}, ops *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		d := tls.Dialer{NetDialer: &net.Dialer{Timeout: time.Second}, Config: cfg}
		if c, err := d.Dial("tcp", addr); err == nil {
			c.Close()
		}
		ops.Add(1)
	}
}

// StalledTLS holds up to hold TCP connections to addr open, each having sent a
// ClientHello of cfg's and nothing more; past hold, one is replaced every millisecond.
// ops counts the connections made.
func StalledTLS(addr string, cfg *tls.Config, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	hello := ClientHello(cfg)
	holdConns(addr, hold, 0, func(int) []byte { return hello }, stop, ops)
}

// NoTLS opens a TCP connection to addr every millisecond that never starts TLS: every
// other one sends the first bytes of a ClientHello record and nothing more. It holds up
// to hold of them open, closing the oldest for each new one past that. ops counts the
// connections made.
func NoTLS(addr string, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	partial := []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00}
	holdConns(addr, hold, time.Millisecond, func(n int) []byte { return partial[:7*(n%2)] }, stop, ops)
}

// holdConns keeps up to hold connections to addr open, the n'th having sent first(n):
// one opened every every (0: at once until hold, then one replaced every millisecond).
func holdConns(addr string, hold int, every time.Duration, first func(n int) []byte, stop <-chan struct{}, ops *atomic.Int64) {
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for n := 0; ; {
		if every > 0 {
			select {
			case <-stop:
				return
			case <-time.After(every):
			}
		} else {
			select {
			case <-stop:
				return
			default:
			}
		}
		if len(open) == hold {
			if every == 0 {
				time.Sleep(time.Millisecond)
			}
			open[0].Close()
			open = open[1:]
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			continue
		}
		if b := first(n); len(b) > 0 {
			c.Write(b)
		}
		open = append(open, c)
		n++
		ops.Add(1)
	}
}

// StalledRedial is the cluster drill's stalled-handshake attacker (deploy/cluster/app's
// stall): hold goroutines each hold one TCP connection to addr that sent a ClientHello of
// cfg's and nothing more, until the server ends it (a refusal, a deadline), then dial
// again 100 ms later. Unlike StalledTLS, a server that refuses such connections gets them
// back at once. ops counts the connections made.
func StalledRedial(addr string, cfg *tls.Config, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	hello := ClientHello(cfg)
	var wg sync.WaitGroup
	for range hold {
		wg.Go(func() {
			for {
				if c, err := net.DialTimeout("tcp", addr, 5*time.Second); err == nil {
					ops.Add(1)
					ended := make(chan struct{})
					go func() {
						select {
						case <-stop:
						case <-ended:
						}
						c.Close()
					}()
					if _, err := c.Write(hello); err == nil {
						io.Copy(io.Discard, c)
					}
					close(ended)
				}
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		})
	}
	wg.Wait()
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
