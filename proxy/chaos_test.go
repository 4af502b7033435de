package proxy_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

const (
	chaosConns    = 200
	chaosParallel = 40
	// chaosDeadline bounds every connection, on the client and on the backend: a proxy
	// that hangs fails the test with a timeout instead of blocking it. With 10 s, 4 MiB
	// slow reads and 2 MB echoes ran out on a machine loaded to 10 runnable threads per
	// core, with today's code and with the code of before this test's last changes alike.
	chaosDeadline = 20 * time.Second
	// chaosEndless caps what the other end of an aborted connection sends while it
	// waits for its write to fail; far more than every buffer on the way holds.
	chaosEndless = 64 << 20
)

// behaviour is how one chaos connection is used and how it ends. Each has its own backend.
type behaviour int

const (
	echoRoundTrip behaviour = iota // client sends, half-closes, reads the echo to EOF
	serverFirst                    // backend sends and half-closes, then the client does
	clientAbort                    // client sends part of a payload, then resets
	backendAbort                   // backend reads part of the client's payload, then resets
	slowReader                     // backend sends 4 MiB to a client reading slowly
	idleClose                      // client sends nothing and closes
	behaviours
)

func (b behaviour) String() string {
	return [...]string{"echo", "server-first", "client-abort", "backend-abort", "slow-reader", "idle-close"}[b]
}

// chaosPlan is one connection, drawn from the seed before any runs.
type chaosPlan struct {
	index int
	kind  behaviour
	a, b  int64 // sizes, whose meaning depends on kind: see chaosPlans
	pause time.Duration
}

func (p chaosPlan) String() string { return fmt.Sprintf("%03d-%v", p.index, p.kind) }

// Each direction of connection i carries its own pattern, so bytes delivered to the wrong
// connection or direction do not match. Echoes use sendAndCheck's patterns from echoSeed.
func upSeed(i uint64) uint64   { return i << 1 }
func downSeed(i uint64) uint64 { return i<<1 | 1 }
func echoSeed(i uint64) uint64 { return 2*chaosConns + i }

// TestChaosMixedConnections runs many concurrent connections through SOCKS5, node A, HBONE
// and node B to backends, each ending in one of six ways picked by a seeded random source
// (TEST_SEED to replay one): clean echoes, half-closes in either order, resets from
// either end, a slow reader, an idle close. Connections that end cleanly must carry
// exactly the bytes sent and end with EOF; aborted ones must end promptly at the other
// end. Afterwards both nodes must have recorded every connection closed, and no
// goroutine, file descriptor or open-socket gauge may be left over.
func TestChaosMixedConnections(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	seed := testSeed(t)
	plans := chaosPlans(seed)

	m := startMesh(t)
	var handled atomic.Int64
	var backends [behaviours]*backend
	for b := range behaviours {
		backends[b] = startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			defer handled.Add(1)
			_ = c.SetDeadline(time.Now().Add(chaosDeadline))
			if err := chaosBackend(b, c); err != nil {
				t.Errorf("%v backend: %v", b, err)
			}
		})
	}

	socks := m.a.socks(t)
	sem := make(chan struct{}, chaosParallel)
	var wg sync.WaitGroup
	for _, p := range plans {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t.Run(p.String(), func(t *testing.T) {
				c, code, err := socksConnect(socks, m.serverIP, backends[p.kind].port())
				if err != nil {
					t.Fatalf("socks5 connect: code %d: %v", code, err)
				}
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(chaosDeadline))
				chaosClient(t, c, p)
			})
		}()
	}
	wg.Wait()

	testutil.Eventually(t, "every backend handler to return", func() bool { return handled.Load() == chaosConns })
	var accepted int64
	for _, be := range backends {
		accepted += be.accepted.Load()
	}
	if accepted != chaosConns {
		t.Errorf("backends accepted %d connections, want %d", accepted, chaosConns)
	}
	for _, n := range []*node{m.a, m.b} {
		reporter := map[string]string{"reporter": "source"}
		if n == m.b {
			reporter = map[string]string{"reporter": "destination"}
		}
		testutil.Eventually(t, n.name+" records every connection closed", func() bool {
			return counter(t, n.reg, "istio_tcp_connections_closed_total", reporter) == chaosConns
		})
		if got := counter(t, n.reg, "istio_tcp_connections_opened_total", reporter); got != chaosConns {
			t.Errorf("%s: %v connections opened, want %d\n%s", n.name, got, chaosConns, dumpCounters(n.reg))
		}
		if got := counter(t, n.reg, "istio_tcp_sockets_open", nil); got != 0 {
			t.Errorf("%s: istio_tcp_sockets_open = %v after every connection closed\n%s", n.name, got, dumpCounters(n.reg))
		}
	}
}

// chaosPlans draws every connection's behaviour and sizes from seed.
func chaosPlans(seed uint64) []chaosPlan {
	rng := rand.New(rand.NewPCG(seed, 0))
	plans := make([]chaosPlan, chaosConns)
	for i := range plans {
		p := chaosPlan{index: i, kind: behaviour(rng.IntN(int(behaviours)))}
		switch p.kind {
		case echoRoundTrip:
			p.a = rng.Int64N(2<<20 + 1) // bytes echoed
		case serverFirst:
			p.a = rng.Int64N(1<<20 + 1) // backend to client
			p.b = rng.Int64N(1<<20 + 1) // then client to backend
		case clientAbort:
			p.a = rng.Int64N(1 << 20) // bytes sent before the reset
		case backendAbort:
			p.a = rng.Int64N(64 << 10) // bytes the backend reads before its reset
		case slowReader:
			p.a = 4 << 20
		case idleClose:
			p.pause = time.Duration(rng.Int64N(int64(50 * time.Millisecond)))
		}
		plans[i] = p
	}
	return plans
}

// chaosClient plays the client's side of p on c and fails t if it goes wrong.
func chaosClient(t *testing.T, c *net.TCPConn, p chaosPlan) {
	i := uint64(p.index)
	switch p.kind {
	case echoRoundTrip:
		sendAndCheck(t, c, p.a, echoSeed(i))

	case serverFirst:
		writeHeader(t, c, p)
		if n, err := readPattern(c, downSeed(i), p.a); err != nil || n != p.a {
			t.Fatalf("read the backend's %d bytes to its FIN: got %d, %v", p.a, n, err)
		}
		if _, err := io.Copy(c, payload(upSeed(i), p.b)); err != nil {
			t.Fatalf("write %d bytes after the backend's FIN: %v", p.b, err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatalf("closewrite: %v", err)
		}

	case clientAbort:
		writeHeader(t, c, p)
		if _, err := io.Copy(c, payload(upSeed(i), p.a)); err != nil {
			t.Fatalf("write %d bytes before the reset: %v", p.a, err)
		}
		_ = c.SetLinger(0)
		c.Close()

	case backendAbort:
		// We send until the backend's reset makes our write fail, and read its FIN or reset.
		werr := make(chan error, 1)
		go func() {
			_, err := io.Copy(c, io.MultiReader(bytes.NewReader(header(p)), payload(upSeed(i), chaosEndless)))
			werr <- err
		}()
		n, rerr := readPattern(c, downSeed(i), 0)
		if errors.Is(rerr, os.ErrDeadlineExceeded) {
			c.Close() // unblock the writer
		}
		err := <-werr
		switch {
		case errors.Is(rerr, os.ErrDeadlineExceeded):
			t.Fatalf("read: no end within %v of the backend's reset (got %d bytes)", chaosDeadline, n)
		case errors.Is(rerr, errWrongBytes):
			t.Fatalf("read after the backend's reset: %v", rerr)
		case errors.Is(err, os.ErrDeadlineExceeded):
			t.Fatalf("write: no end within %v of the backend's reset", chaosDeadline)
		case err == nil:
			t.Fatalf("wrote all %d bytes to a backend that had reset after %d", chaosEndless, p.a)
		}

	case slowReader:
		writeHeader(t, c, p)
		if err := c.CloseWrite(); err != nil {
			t.Fatalf("closewrite: %v", err)
		}
		if n, err := readPattern(slow{c}, downSeed(i), p.a); err != nil || n != p.a {
			t.Fatalf("slow read of %d bytes to the backend's FIN: got %d, %v", p.a, n, err)
		}

	case idleClose:
		time.Sleep(p.pause)
		c.Close()
	}
}

// chaosBackend plays the backend's side of behaviour b on c. Connections that identify
// themselves by a header are named in the error.
func chaosBackend(b behaviour, c *net.TCPConn) error {
	switch b {
	case echoRoundTrip:
		echo(c)

	case serverFirst:
		if err := serveServerFirst(c); err != nil {
			return err
		}

	case clientAbort:
		// The reset may overtake the header; then there is nothing to check but the end.
		h, err := readHeader(c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("header: no end within %v of the client's reset", chaosDeadline)
		}
		if err != nil {
			return nil
		}
		// Meanwhile we send until the client's reset makes our write fail.
		i := uint64(h.index)
		werr := make(chan error, 1)
		go func() {
			_, err := io.Copy(c, payload(downSeed(i), chaosEndless))
			werr <- err
		}()
		n, rerr := readPattern(c, upSeed(i), h.a)
		if errors.Is(rerr, os.ErrDeadlineExceeded) {
			c.Close() // unblock the writer
		}
		err = <-werr
		switch {
		case errors.Is(rerr, os.ErrDeadlineExceeded):
			return fmt.Errorf("conn %d: read: no end within %v of the client's reset (got %d of %d bytes)", i, chaosDeadline, n, h.a)
		case errors.Is(rerr, errWrongBytes):
			return fmt.Errorf("conn %d: %w", i, rerr)
		case errors.Is(err, os.ErrDeadlineExceeded):
			return fmt.Errorf("conn %d: write: no end within %v of the client's reset", i, chaosDeadline)
		case err == nil:
			return fmt.Errorf("conn %d: wrote all %d bytes to a client that had reset", i, chaosEndless)
		}

	case backendAbort:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		if n, err := readPattern(io.LimitReader(c, h.a), upSeed(uint64(h.index)), chaosEndless); err != nil || n != h.a {
			return fmt.Errorf("conn %d: read %d bytes before the reset: got %d, %v", h.index, h.a, n, err)
		}
		_ = c.SetLinger(0) // the backend's caller closes c: a reset

	case slowReader:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		if _, err := io.Copy(c, payload(downSeed(uint64(h.index)), h.a)); err != nil {
			return fmt.Errorf("conn %d: write %d bytes to a slow reader: %w", h.index, h.a, err)
		}
		if err := c.CloseWrite(); err != nil {
			return fmt.Errorf("conn %d: closewrite: %w", h.index, err)
		}
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			return fmt.Errorf("conn %d: after the header: %d bytes, %v; want EOF", h.index, n, err)
		}

	case idleClose:
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			return fmt.Errorf("got %d bytes, %v; want EOF at once", n, err)
		}
	}
	return nil
}

// header tells the backend which connection this is and its sizes: index, a, b.
func header(p chaosPlan) []byte {
	h := binary.BigEndian.AppendUint64(nil, uint64(p.index))
	h = binary.BigEndian.AppendUint64(h, uint64(p.a))
	return binary.BigEndian.AppendUint64(h, uint64(p.b))
}

func writeHeader(t *testing.T, c *net.TCPConn, p chaosPlan) {
	t.Helper()
	if _, err := c.Write(header(p)); err != nil {
		t.Fatalf("write header: %v", err)
	}
}

func readHeader(r io.Reader) (chaosPlan, error) {
	var h [24]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return chaosPlan{}, err
	}
	return chaosPlan{
		index: int(binary.BigEndian.Uint64(h[0:])),
		a:     int64(binary.BigEndian.Uint64(h[8:])),
		b:     int64(binary.BigEndian.Uint64(h[16:])),
	}, nil
}

var errWrongBytes = errors.New("wrong bytes")

// readPattern reads r to EOF, checking that what arrives is the start of payload(seed,
// max). It returns how many bytes arrived and the first problem: errWrongBytes (different
// bytes, or more than max), or the read error; nil at EOF.
func readPattern(r io.Reader, seed uint64, max int64) (int64, error) {
	want := payload(seed, max)
	buf, exp := make([]byte, 32<<10), make([]byte, 32<<10)
	var n int64
	for {
		k, err := r.Read(buf)
		if k > 0 {
			e, _ := io.ReadFull(want, exp[:k])
			if e < k {
				return n, fmt.Errorf("%w: more than the %d bytes sent", errWrongBytes, max)
			}
			if !bytes.Equal(buf[:k], exp[:k]) {
				return n, fmt.Errorf("%w in bytes %d to %d of %d", errWrongBytes, n, n+int64(k), max)
			}
			n += int64(k)
		}
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// slow reads at most 64 KiB at a time and pauses after each read, so the proxies' buffers
// and HTTP/2 flow-control windows fill up behind it. (With 16 KiB reads a 4 MiB read took
// 256 pauses, and on a loaded machine, where a 1 ms sleep can take tens, that alone ran
// past chaosDeadline.)
type slow struct{ r io.Reader }

func (s slow) Read(p []byte) (int, error) {
	if len(p) > 64<<10 {
		p = p[:64<<10]
	}
	n, err := s.r.Read(p)
	time.Sleep(time.Millisecond)
	return n, err
}

// serveServerFirst is the backend of a server-first connection: it reads the header,
// sends its a bytes and a FIN, then expects the client's b bytes.
func serveServerFirst(c *net.TCPConn) error {
	h, err := readHeader(c)
	if err != nil {
		return fmt.Errorf("header: %w", err)
	}
	i := uint64(h.index)
	if _, err := io.Copy(c, payload(downSeed(i), h.a)); err != nil {
		return fmt.Errorf("conn %d: write %d bytes: %w", i, h.a, err)
	}
	if err := c.CloseWrite(); err != nil {
		return fmt.Errorf("conn %d: closewrite: %w", i, err)
	}
	if n, err := readPattern(c, upSeed(i), h.b); err != nil || n != h.b {
		return fmt.Errorf("conn %d: read the client's %d bytes after our FIN: got %d, %v", i, h.b, n, err)
	}
	return nil
}
