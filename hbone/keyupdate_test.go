package hbone

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/ktls"
	"github.com/gozt/gozt/internal/leaktest"
)

// A TLS 1.3 peer that sends KeyUpdates: crypto/tls never sends one of its own, so this
// peer runs crypto/tls's handshake and then its own record layer (RFC 8446 §5.2, §7.2),
// which can send a KeyUpdate with or without update_requested between any two records
// and follows the other side's.

// exactConn hands crypto/tls at most the rest of the current TLS record per Read, so it
// reads nothing past the handshake's last record (ktls's recordConn does the same).
type exactConn struct {
	net.Conn
	hdr        [5]byte
	nhdr, body int
}

func (c *exactConn) Read(p []byte) (int, error) {
	if c.nhdr < 5 {
		n, err := c.Conn.Read(p[:min(len(p), 5-c.nhdr)])
		copy(c.hdr[c.nhdr:], p[:n])
		if c.nhdr += n; c.nhdr == 5 {
			c.body = int(binary.BigEndian.Uint16(c.hdr[3:]))
		}
		return n, err
	}
	n, err := c.Conn.Read(p[:min(len(p), c.body)])
	if c.body -= n; c.body == 0 {
		c.nhdr = 0
	}
	return n, err
}

// secretLog keeps a connection's application traffic secrets from the key log.
type secretLog struct {
	mu             sync.Mutex
	client, server []byte
}

func (l *secretLog) Write(line []byte) (int, error) {
	f := strings.Fields(string(line))
	if len(f) == 3 {
		b, _ := hex.DecodeString(f[2])
		l.mu.Lock()
		switch f[0] {
		case "CLIENT_TRAFFIC_SECRET_0":
			l.client = b
		case "SERVER_TRAFFIC_SECRET_0":
			l.server = b
		}
		l.mu.Unlock()
	}
	return len(line), nil
}

// direction is one direction's keys: RFC 8446 §7.3 from its traffic secret.
type direction struct {
	secret []byte
	aead   cipher.AEAD
	iv     []byte
	seq    uint64
}

func expandLabel(h func() hash.Hash, secret []byte, label string, n int) []byte {
	info := binary.BigEndian.AppendUint16(nil, uint16(n))
	info = append(info, byte(6+len(label)))
	info = append(info, "tls13 "+label...)
	info = append(info, 0)
	out, err := hkdf.Expand(h, secret, string(info), n)
	if err != nil {
		panic(err)
	}
	return out
}

func (d *direction) set(h func() hash.Hash, keyLen int, secret []byte) {
	block, err := aes.NewCipher(expandLabel(h, secret, "key", keyLen))
	if err != nil {
		panic(err)
	}
	d.aead, _ = cipher.NewGCM(block)
	d.secret, d.iv, d.seq = secret, expandLabel(h, secret, "iv", 12), 0
}

// next is the KeyUpdate: traffic_secret_N+1 = HKDF-Expand-Label(secret_N, "traffic upd", "", Hash.length).
func (d *direction) next(h func() hash.Hash, keyLen int) {
	d.set(h, keyLen, expandLabel(h, d.secret, "traffic upd", h().Size()))
}

func (d *direction) nonce() []byte {
	n := append([]byte(nil), d.iv...)
	for i := range 8 {
		n[4+i] ^= byte(d.seq >> (56 - 8*i))
	}
	d.seq++
	return n
}

// updatingConn is the peer's record layer over the raw connection, as a net.Conn.
type updatingConn struct {
	net.Conn // raw TCP, for addresses and deadlines
	hash     func() hash.Hash
	keyLen   int

	wmu sync.Mutex
	tx  direction

	rx      direction // the reader's
	pending []byte

	followed  atomic.Int32 // KeyUpdates of the other side followed
	sentReqs  atomic.Int32 // KeyUpdates sent with update_requested
	recordsRX atomic.Int64
}

func newUpdatingConn(tc *tls.Conn, raw net.Conn, l *secretLog, server bool) (*updatingConn, error) {
	st := tc.ConnectionState()
	u := &updatingConn{Conn: raw}
	switch st.CipherSuite {
	case tls.TLS_AES_128_GCM_SHA256:
		u.hash, u.keyLen = sha256.New, 16
	case tls.TLS_AES_256_GCM_SHA384:
		u.hash, u.keyLen = sha512.New384, 32
	default:
		return nil, fmt.Errorf("suite %s: the test peer does AES-GCM only", tls.CipherSuiteName(st.CipherSuite))
	}
	l.mu.Lock()
	tx, rx := l.client, l.server
	l.mu.Unlock()
	if server {
		tx, rx = rx, tx
	}
	u.tx.set(u.hash, u.keyLen, tx)
	u.rx.set(u.hash, u.keyLen, rx)
	return u, nil
}

func (u *updatingConn) writeRecordLocked(typ byte, data []byte) error {
	inner := append(append([]byte(nil), data...), typ)
	hdr := []byte{23, 3, 3, 0, 0}
	binary.BigEndian.PutUint16(hdr[3:], uint16(len(inner)+u.tx.aead.Overhead()))
	rec := u.tx.aead.Seal(hdr, u.tx.nonce(), inner, hdr)
	_, err := u.Conn.Write(rec)
	return err
}

func (u *updatingConn) Write(p []byte) (int, error) {
	u.wmu.Lock()
	defer u.wmu.Unlock()
	for n := 0; n < len(p); {
		k := min(len(p)-n, 16384)
		if err := u.writeRecordLocked(23, p[n:n+k]); err != nil {
			return n, err
		}
		n += k
	}
	return len(p), nil
}

// SendKeyUpdate sends a KeyUpdate and switches to the next write key.
func (u *updatingConn) SendKeyUpdate(requested bool) error {
	u.wmu.Lock()
	defer u.wmu.Unlock()
	req := byte(0)
	if requested {
		req = 1
		u.sentReqs.Add(1)
	}
	if err := u.writeRecordLocked(22, []byte{24, 0, 0, 1, req}); err != nil {
		return err
	}
	u.tx.next(u.hash, u.keyLen)
	return nil
}

func (u *updatingConn) Read(p []byte) (int, error) {
	for len(u.pending) == 0 {
		var hdr [5]byte
		if _, err := io.ReadFull(u.Conn, hdr[:]); err != nil {
			return 0, err
		}
		body := make([]byte, binary.BigEndian.Uint16(hdr[3:]))
		if _, err := io.ReadFull(u.Conn, body); err != nil {
			return 0, err
		}
		plain, err := u.rx.aead.Open(body[:0], u.rx.nonce(), body, hdr[:])
		if err != nil {
			return 0, fmt.Errorf("test peer: record %d: %w", u.rx.seq-1, err)
		}
		u.recordsRX.Add(1)
		i := len(plain) - 1
		for i >= 0 && plain[i] == 0 {
			i--
		}
		if i < 0 {
			return 0, errors.New("test peer: record without a content type")
		}
		typ, data := plain[i], plain[:i]
		switch typ {
		case 23:
			u.pending = data
		case 21:
			return 0, io.EOF
		case 22:
			for len(data) >= 4 {
				n := int(data[1])<<16 | int(data[2])<<8 | int(data[3])
				msg := data[4 : 4+n]
				if data[0] == 24 { // KeyUpdate
					u.rx.next(u.hash, u.keyLen)
					u.followed.Add(1)
					if msg[0] == 1 {
						if err := u.SendKeyUpdate(false); err != nil {
							return 0, err
						}
					}
				}
				data = data[4+n:]
			}
		}
	}
	n := copy(p, u.pending)
	u.pending = u.pending[n:]
	return n, nil
}

// keyUpdatePeer is an HBONE server (Server.ServeConn over updatingConn, echoing) whose
// connections send KeyUpdates when the test says.
type keyUpdatePeer struct {
	addr  string
	conns chan *updatingConn
}

// startKeyUpdatePeer starts a server that can send KeyUpdates, offering the ALPN protocols
// protos: ["h2"] as the Rust ztunnel's rustls, or NextProtoNoKeyUpdate first as gozt (a
// peer breaking that promise).
func startKeyUpdatePeer(t *testing.T, protos ...string) *keyUpdatePeer {
	t.Helper()
	testCA()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &keyUpdatePeer{addr: ln.Addr().String(), conns: make(chan *updatingConn, 4)}
	srv := NewServer(ServerConfig{}, echo)
	serveEach(t, ln, srv, func(ctx context.Context, raw net.Conn) {
		var l secretLog
		cfg := srvTLS.Clone()
		cfg.KeyLogWriter, cfg.SessionTicketsDisabled, cfg.MinVersion = &l, true, tls.VersionTLS13
		cfg.NextProtos = protos
		tc := tls.Server(&exactConn{Conn: raw}, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return
		}
		u, err := newUpdatingConn(tc, raw, &l, true)
		if err != nil {
			t.Error(err)
			raw.Close()
			return
		}
		p.conns <- u
		srv.ServeConn(ctx, u)
	})
	return p
}

// TestPeerKeyUpdate: a peer sends KeyUpdates in the middle of a stream, without and then
// with update_requested, while 4 MiB go each way. On the user-space path (crypto/tls)
// the pool's connection follows both, answers the request with its own KeyUpdate (which
// the peer follows), and every byte comes back: hashed at both ends. (Under kernel TLS,
// TestKernelTLSPeerKeyUpdate.)
func TestPeerKeyUpdate(t *testing.T) {
	leaktest.Check(t)
	testPeerKeyUpdate(t, false, "h2")
}

// testPeerKeyUpdate runs TestPeerKeyUpdate's stream with the pool on kernel TLS or not,
// against a peer offering protos. The connection moves to the kernel only when both ask
// for it and the peer promised NextProtoNoKeyUpdate.
func testPeerKeyUpdate(t *testing.T, kernelTLS bool, protos ...string) {
	peer := startKeyUpdatePeer(t, protos...)
	pool := NewPool(ClientConfig{Config: Config{DisableKernelTLS: !kernelTLS}}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	addr := netip.MustParseAddrPort(peer.addr)
	k := NewKey(mustID(clientID), ids(serverID), addr, z0)
	s, err := pool.Dial(context.Background(), k, "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	u := <-peer.conns
	userSpace := !kernelTLS || protos[0] != NextProtoNoKeyUpdate
	if got := s.KernelTLS(); got == userSpace {
		t.Fatalf("kernel TLS %v; want %v", got, !userSpace)
	}

	const size, chunk = 4 << 20, 32 << 10
	sentHash, gotHash := sha256.New(), sha256.New()
	writeErr := make(chan error, 1)
	go func() {
		buf := make([]byte, chunk)
		for i := 0; i < size/chunk; i++ {
			for j := range buf {
				buf[j] = byte(i*7 + j)
			}
			sentHash.Write(buf)
			if _, err := s.Write(buf); err != nil {
				writeErr <- err
				return
			}
		}
		writeErr <- s.CloseWrite()
	}()
	buf := make([]byte, chunk)
	var got int
	var readErr error
	for readErr == nil {
		var n int
		n, readErr = s.Read(buf)
		gotHash.Write(buf[:n])
		prev := got
		got += n
		// The peer's KeyUpdates, mid-stream: its echo of what it read so far goes out
		// under the old key, the rest under the new one.
		switch {
		case prev < size/4 && got >= size/4:
			if err := u.SendKeyUpdate(false); err != nil {
				t.Fatal(err)
			}
		case prev < size/2 && got >= size/2:
			if err := u.SendKeyUpdate(true); err != nil {
				t.Fatal(err)
			}
		}
	}
	werr := <-writeErr
	if !userSpace {
		// A peer that promised no KeyUpdate and sent one: kernel TLS cannot follow, the
		// connection ends at the first KeyUpdate, the stream fails (never a clean EOF), and
		// the pool dials a fresh connection.
		if !errors.Is(readErr, ErrConnClosed) || !errors.Is(readErr, ktls.ErrKeyUpdate) {
			t.Fatalf("stream read after the peer's KeyUpdate: %v (%d of %d bytes); want ErrConnClosed for ktls.ErrKeyUpdate", readErr, got, size)
		}
		s2, err := pool.Dial(context.Background(), k, "10.0.0.1:80", nil)
		if err != nil {
			t.Fatalf("Dial after the KeyUpdate: %v", err)
		}
		defer s2.Close()
		if s2.c == s.c {
			t.Fatal("the pool reused the connection the KeyUpdate ended")
		}
		return
	}
	if readErr != io.EOF || werr != nil {
		t.Fatalf("read %d of %d bytes, then %v; write: %v", got, size, readErr, werr)
	}
	if string(sentHash.Sum(nil)) != string(gotHash.Sum(nil)) || got != size {
		t.Fatalf("%d bytes came back, hash differs from what was sent: %v", got, string(sentHash.Sum(nil)) != string(gotHash.Sum(nil)))
	}
	// The pool's side answered update_requested with its own KeyUpdate, which the peer
	// followed (and read the rest of the stream under).
	deadline := time.Now().Add(10 * time.Second)
	for u.followed.Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if f, r := u.followed.Load(), u.sentReqs.Load(); f != 1 || r != 1 {
		t.Fatalf("the peer followed %d KeyUpdates after sending %d requests; want 1 and 1", f, r)
	}
}

// TestKeyLimitPerKey: the sent-record count is per key. A peer's KeyUpdate without
// update_requested leaves our key, and the count, as they are; with update_requested
// crypto/tls answers with a KeyUpdate of its own and the count restarts. The connection
// then carries past the drain point and the hard limit its first key had, with no drain
// and no reset, until its new key reaches the drain point.
func TestKeyLimitPerKey(t *testing.T) {
	leaktest.Check(t)
	const drainAt, maxTX = 330, 400
	ev := newKeyEvents()
	peer := startKeyUpdatePeer(t, "h2")
	pool := NewPool(ClientConfig{Config: Config{DisableKernelTLS: true, KeyDrainRecords: drainAt, KeyMaxRecords: maxTX, OnKeyLimit: ev.on}},
		func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	k := NewKey(mustID(clientID), ids(serverID), netip.MustParseAddrPort(peer.addr), z0)
	s, err := pool.Dial(context.Background(), k, "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	u := <-peer.conns
	sent := func() uint64 {
		tx, _, err := s.c.records()
		if err != nil {
			t.Fatal(err)
		}
		return tx
	}
	// messages sends pingPong messages until the records sent under the current key
	// reach n.
	messages := func(n uint64, seed byte) {
		t.Helper()
		for i := 0; sent() < n; i++ {
			if i > int(n) {
				t.Fatalf("%d messages and %d records sent; want %d", i, sent(), n)
			}
			if err := pingPong(t, s, 1, seed+byte(i)); err != nil {
				t.Fatalf("at %d records under the current key: %v", sent(), err)
			}
		}
	}
	messages(drainAt-150, 'a')
	// Writes that crypto/tls cuts into records and a tail of 5 bytes (once 128 KiB have
	// gone, its records are full: 16 KiB), a KeyUpdate's length: none is taken for one.
	msg, echoed := make([]byte, 2<<14+5), make([]byte, 2<<14+5)
	tailsFrom := sent()
	for i := range 8 {
		msg[0] = byte(i)
		if _, err := s.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, echoed); err != nil || echoed[0] != byte(i) {
			t.Fatalf("echo: %v", err)
		}
	}
	if got := sent(); got < tailsFrom+8*3 {
		t.Fatalf("%d records under the current key after 8 writes of 3 records from %d: a tail was taken for a KeyUpdate", got, tailsFrom)
	}
	before := sent()
	if err := u.SendKeyUpdate(false); err != nil {
		t.Fatal(err)
	}
	if err := pingPong(t, s, 10, 'b'); err != nil { // read past the KeyUpdate: echoed after it
		t.Fatal(err)
	}
	if got := sent(); got < before+10 {
		t.Fatalf("%d records sent after the peer's KeyUpdate without update_requested; want the count to go on from %d", got, before)
	}
	if err := u.SendKeyUpdate(true); err != nil {
		t.Fatal(err)
	}
	for i := 0; u.followed.Load() == 0; i++ {
		// Each message makes the pool's frame reader read, and so answer the request.
		if i > 100 {
			t.Fatal("no KeyUpdate from the pool's connection after the peer's update_requested")
		}
		if err := pingPong(t, s, 1, 'c'); err != nil {
			t.Fatal(err)
		}
	}
	// Past the first key's hard limit, all under the new one.
	for i := 0; s.c.bc.tx.n.Load() < maxTX+50; i++ {
		if i > maxTX {
			t.Fatalf("%d messages; the connection has sent %d records", i, s.c.bc.tx.n.Load())
		}
		if err := pingPong(t, s, 1, 'd'+byte(i)); err != nil {
			t.Fatalf("after %d records in all, %d under the new key: %v", s.c.bc.tx.n.Load(), sent(), err)
		}
	}
	if got := sent(); got >= drainAt-20 {
		t.Fatalf("%d records in all, %d under the new key; want the count restarted at the KeyUpdate", s.c.bc.tx.n.Load(), got)
	}
	t.Logf("%d records sent in all, %d under the new key", s.c.bc.tx.n.Load(), sent())
	select {
	case l := <-ev.ch:
		t.Fatalf("OnKeyLimit heard %+v under a new key %d records in", l, sent())
	default:
	}
	if s.c.leaving() {
		t.Fatal("the connection drained under a key that has not reached the drain point")
	}
	// The new key reaches the drain point: the connection drains, its stream carries on.
	messages(drainAt+5, 'e')
	l := ev.wait(t, "drain")
	if l.Server || l.TX < drainAt || l.TX > drainAt+20 || l.Streams != 1 {
		t.Errorf("OnKeyLimit heard %+v; want the client's drain at about %d records of its new key", l, drainAt)
	}
	waitLeaving(t, s)
	if err := pingPong(t, s, 5, 'f'); err != nil {
		t.Fatalf("the stream across the drain: %v", err)
	}
}
