package ktls

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"errors"
	"io"
	"math/big"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDeriveKeysRFC8448 checks the key schedule's last step against RFC 8448 §3 ("Simple
// 1-RTT Handshake", TLS_AES_128_GCM_SHA256): the application traffic secrets give the
// write keys and IVs the RFC lists.
func TestDeriveKeysRFC8448(t *testing.T) {
	s, _ := suiteOf(tls.TLS_AES_128_GCM_SHA256)
	for _, tc := range []struct {
		name, secret, key, iv string
	}{
		{"client", "9e40646ce79a7f9dc05af8889bce6552875afa0b06df0087f792ebb7c17504a5", "17422dda596ed5d9acd890e3c63f5051", "5b78923dee08579033e523d9"},
		{"server", "a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643", "9f02283b6c9c07efc26bb9f2ac92e356", "cf782b88dd83549aadf1e984"},
		// The server handshake traffic secret and its keys, same derivation, same RFC.
		{"server handshake", "b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38", "3fce516009c21727d0f2e4e86ee403bc", "5d313eb2671276ee13000b30"},
	} {
		key, iv, err := deriveKeys(s, unhex(t, tc.secret))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := hex.EncodeToString(key), tc.key; got != want {
			t.Errorf("%s key = %s; want %s", tc.name, got, want)
		}
		if got, want := hex.EncodeToString(iv), tc.iv; got != want {
			t.Errorf("%s iv = %s; want %s", tc.name, got, want)
		}
	}
}

func TestDeriveKeysLengths(t *testing.T) {
	for _, tc := range []struct {
		suite     uint16
		secretLen int
		keyLen    int
	}{
		{tls.TLS_AES_128_GCM_SHA256, 32, 16},
		{tls.TLS_AES_256_GCM_SHA384, 48, 32},
		{tls.TLS_CHACHA20_POLY1305_SHA256, 32, 32},
	} {
		s, ok := suiteOf(tc.suite)
		if !ok {
			t.Fatalf("suite %s unknown", tls.CipherSuiteName(tc.suite))
		}
		key, iv, err := deriveKeys(s, make([]byte, tc.secretLen))
		if err != nil || len(key) != tc.keyLen || len(iv) != 12 {
			t.Errorf("%s: key %d bytes, iv %d, err %v; want %d, 12, nil", tls.CipherSuiteName(tc.suite), len(key), len(iv), err, tc.keyLen)
		}
		if _, _, err := deriveKeys(s, make([]byte, tc.secretLen-1)); err == nil {
			t.Errorf("%s: a short secret was accepted", tls.CipherSuiteName(tc.suite))
		}
	}
	if _, ok := suiteOf(tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256); ok {
		t.Error("a TLS 1.2 suite was taken for a TLS 1.3 one")
	}
}

// testConfigs returns mutual-TLS configs as HBONE uses them: one self-signed certificate
// both sides present and trust.
func testConfigs(t testing.TB) (client, server *tls.Config) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "ktls test"},
		DNSNames:     []string{"ktls.test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	client = &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ServerName: "ktls.test", MinVersion: tls.VersionTLS13}
	server = &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13}
	return client, server
}

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t testing.TB) (a, b *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err = net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	b, err = ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

type side struct {
	tc *tls.Conn
	h  *Handoff // nil: a plain crypto/tls peer
}

// handshake connects a client and a server over loopback, each through ktls's Client and
// Server (prepared) or plain crypto/tls, and completes the handshake on both.
func handshake(t testing.TB, ccfg, scfg *tls.Config, prepClient, prepServer bool) (client, server side) {
	t.Helper()
	ca, sa := tcpPair(t)
	if prepClient {
		client.tc, client.h = Client(ca, ccfg)
	} else {
		client.tc = tls.Client(ca, ccfg)
	}
	if prepServer {
		server.tc, server.h = Server(sa, scfg)
	} else {
		server.tc = tls.Server(sa, scfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	run := func(s side) error {
		if s.h != nil {
			return s.h.Handshake(ctx)
		}
		return s.tc.HandshakeContext(ctx)
	}
	errc := make(chan error, 1)
	go func() { errc <- run(server) }()
	if err := run(client); err != nil {
		t.Fatalf("client handshake: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("server handshake: %v", err)
	}
	return client, server
}

// exchange sends size pseudo-random bytes each way at once, each side half-closing its
// write side when done, and checks that each side read what the other sent (SHA-256).
func exchange(t testing.TB, a, b net.Conn, size int) {
	t.Helper()
	type result struct {
		sent, got [32]byte
		err       error
	}
	run := func(c net.Conn, seed byte, out chan<- result) {
		var r result
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := sha256.New()
			_, r.err = io.Copy(h, c)
			copy(r.got[:], h.Sum(nil))
		}()
		h := sha256.New()
		src := io.TeeReader(io.LimitReader(newStream(seed), int64(size)), h)
		_, werr := io.Copy(c, src)
		if werr == nil {
			werr = c.(interface{ CloseWrite() error }).CloseWrite()
		}
		copy(r.sent[:], h.Sum(nil))
		wg.Wait()
		if r.err == nil {
			r.err = werr
		}
		out <- r
	}
	// A lost record shows as a stall, not an error: fail in a minute, not at the
	// test binary's timeout.
	deadline := time.Now().Add(time.Minute)
	a.SetDeadline(deadline)
	b.SetDeadline(deadline)
	ra, rb := make(chan result, 1), make(chan result, 1)
	go run(a, 1, ra)
	go run(b, 2, rb)
	x, y := <-ra, <-rb
	if x.err != nil || y.err != nil {
		t.Fatalf("exchange: %v / %v", x.err, y.err)
	}
	if x.sent != y.got || y.sent != x.got {
		t.Fatalf("payload hashes differ: a sent %x, b got %x; b sent %x, a got %x", x.sent[:4], y.got[:4], y.sent[:4], x.got[:4])
	}
}

// stream is a cheap deterministic byte source (xorshift), so the tests' payloads are not
// all zeros and differ per direction.
type stream struct{ x uint64 }

func newStream(seed byte) *stream { return &stream{x: 0x9e3779b97f4a7c15 * uint64(seed+1)} }

func (s *stream) Read(p []byte) (int, error) {
	for i := range p {
		s.x ^= s.x << 13
		s.x ^= s.x >> 7
		s.x ^= s.x << 17
		p[i] = byte(s.x)
	}
	return len(p), nil
}

// kernelTLS reports whether this kernel takes the "tls" ULP on a TCP socket.
func kernelTLS(t testing.TB) bool {
	t.Helper()
	a, _ := tcpPair(t)
	rc, err := a.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	ok := false
	_ = rc.Control(func(fd uintptr) { ok = setULP(int(fd)) == nil })
	return ok
}

// TestFallbackWithoutKernelTLS runs where the kernel has no TLS (this repo's CI hosts):
// Enable says so, and the *tls.Conn carries on.
func TestFallbackWithoutKernelTLS(t *testing.T) {
	leaktest.Check(t)
	if kernelTLS(t) {
		t.Skip("this kernel has TLS: the fallback is not taken (the VM tests cover the switch)")
	}
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, true)
	for _, s := range []side{client, server} {
		kc, err := s.h.Enable()
		var fe *FallbackError
		if kc != nil || !errors.As(err, &fe) {
			t.Fatalf("Enable = %v, %v; want a *FallbackError", kc, err)
		}
		if fe.Reason != ReasonNoKernelTLS && fe.Reason != ReasonNotSupported || fe.Unusable {
			t.Fatalf("Enable: %v (reason %q, unusable %v); want %q", err, fe.Reason, fe.Unusable, ReasonNoKernelTLS)
		}
	}
	exchange(t, client.tc, server.tc, 1<<20)
}

// TestFallbackReasons: every refusal before the kernel is asked leaves a working
// *tls.Conn, with its own reason.
func TestFallbackReasons(t *testing.T) {
	leaktest.Check(t)
	ccfg, scfg := testConfigs(t)
	t.Run("tls12", func(t *testing.T) {
		c12, s12 := ccfg.Clone(), scfg.Clone()
		c12.MinVersion, c12.MaxVersion, s12.MinVersion = tls.VersionTLS12, tls.VersionTLS12, tls.VersionTLS12
		client, server := handshake(t, c12, s12, true, true)
		checkFallback(t, client, ReasonTLSVersion)
		checkFallback(t, server, ReasonTLSVersion)
		exchange(t, client.tc, server.tc, 64<<10)
	})
	t.Run("used", func(t *testing.T) {
		client, server := handshake(t, ccfg, scfg, true, true)
		if _, err := client.tc.Write([]byte("early")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 5)
		if _, err := io.ReadFull(server.tc, buf); err != nil || string(buf) != "early" {
			t.Fatalf("read %q, %v", buf, err)
		}
		checkFallback(t, client, ReasonUsed)
		checkFallback(t, server, ReasonUsed)
		exchange(t, client.tc, server.tc, 64<<10)
	})
	t.Run("no handshake", func(t *testing.T) {
		ca, sa := tcpPair(t)
		tc, h := Client(ca, ccfg)
		ts := tls.Server(sa, scfg)
		go func() { _ = ts.Handshake() }()
		if err := tc.Handshake(); err != nil { // not through the Handoff
			t.Fatal(err)
		}
		checkFallback(t, side{tc, h}, ReasonNoHandshake)
		tc.Close()
		ts.Close()
	})
	t.Run("twice", func(t *testing.T) {
		client, _ := handshake(t, ccfg, scfg, true, false)
		_, _ = client.h.Enable()
		if _, err := client.h.Enable(); err == nil {
			t.Fatal("second Enable succeeded")
		}
	})
}

// tinyReads is a TCPWrapper that counts the reads that returned no more than a record
// header's 5 bytes.
type tinyReads struct {
	*net.TCPConn
	n atomic.Int64
}

func (c *tinyReads) Read(p []byte) (int, error) {
	n, err := c.TCPConn.Read(p)
	if n > 0 && n <= 5 {
		c.n.Add(1)
	}
	return n, err
}

func (c *tinyReads) TCP() *net.TCPConn { return c.TCPConn }

// TestDecline: a connection the caller keeps in crypto/tls after a handshake through
// Client and Server (Decline) carries on, reading in bulk rather than a record header at
// a time, and cannot be enabled any more.
func TestDecline(t *testing.T) {
	leaktest.Check(t)
	ccfg, scfg := testConfigs(t)
	ca, sa := tcpPair(t)
	cr, sr := &tinyReads{TCPConn: ca}, &tinyReads{TCPConn: sa}
	ctc, ch := Client(cr, ccfg)
	stc, sh := Server(sr, scfg)
	errc := make(chan error, 1)
	go func() { errc <- sh.Handshake(context.Background()) }()
	if err := ch.Handshake(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	handshakeTiny := cr.n.Load() + sr.n.Load()
	ch.Decline()
	sh.Decline()
	exchange(t, ctc, stc, 4<<20)
	// 4 MiB each way is 256 full records or more: reading record by record, as during
	// the handshake, would take a tiny read for each.
	if tiny := cr.n.Load() + sr.n.Load() - handshakeTiny; tiny > 64 {
		t.Errorf("%d reads of a record header or less after Decline; want reads in bulk", tiny)
	}
	if kc, err := ch.Enable(); kc != nil || err == nil {
		t.Errorf("Enable after Decline = %v, %v; want an error", kc, err)
	}
}

// TestFIPSModeRefused: in FIPS 140-3 mode neither Available nor Enable hands a connection
// to the kernel, whether or not it has kernel TLS (the VM's has), and the *tls.Conn
// carries on.
func TestFIPSModeRefused(t *testing.T) {
	if !testutil.InFIPSMode(t) {
		return
	}
	leaktest.Check(t)
	a, _ := tcpPair(t)
	var fe *FallbackError
	if err := Available(a); !errors.As(err, &fe) || fe.Reason != ReasonFIPS {
		t.Errorf("Available = %v; want reason %q", err, ReasonFIPS)
	}
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, true)
	checkFallback(t, client, ReasonFIPS)
	checkFallback(t, server, ReasonFIPS)
	exchange(t, client.tc, server.tc, 64<<10)
}

func checkFallback(t *testing.T, s side, want Reason) {
	t.Helper()
	_, err := s.h.Enable()
	var fe *FallbackError
	if !errors.As(err, &fe) || fe.Reason != want || fe.Unusable {
		t.Fatalf("Enable: %v; want reason %q", err, want)
	}
}

// TestKeyLogChained: a KeyLogWriter the caller configured still sees every line.
func TestKeyLogChained(t *testing.T) {
	ccfg, scfg := testConfigs(t)
	var buf bytes.Buffer
	ccfg.KeyLogWriter = &buf
	client, _ := handshake(t, ccfg, scfg, true, false)
	if !strings.Contains(buf.String(), "CLIENT_TRAFFIC_SECRET_0 ") || !strings.Contains(buf.String(), "SERVER_TRAFFIC_SECRET_0 ") {
		t.Fatalf("key log = %q", buf.String())
	}
	c, s, err := client.h.log.secrets()
	if err != nil || len(c) != 32 || len(s) != 32 {
		t.Fatalf("secrets: %d, %d bytes, %v", len(c), len(s), err)
	}
}

// TestKeyLogGetConfigForClient: a server config whose GetConfigForClient returns the
// config that runs the handshake (as identity/certs' does) still gets the secrets, and
// its own KeyLogWriter still sees them.
func TestKeyLogGetConfigForClient(t *testing.T) {
	ccfg, scfg := testConfigs(t)
	var buf bytes.Buffer
	inner := scfg.Clone()
	inner.KeyLogWriter = &buf
	outer := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return inner, nil }}
	_, server := handshake(t, ccfg, outer, false, true)
	if !strings.Contains(buf.String(), "SERVER_TRAFFIC_SECRET_0 ") {
		t.Errorf("the inner config's key log = %q", buf.String())
	}
	if inner.KeyLogWriter != &buf || inner.SessionTicketsDisabled {
		t.Error("the caller's config was changed")
	}
	c, s, err := server.h.log.secrets()
	if err != nil || len(c) != 32 || len(s) != 32 {
		t.Fatalf("secrets: %d, %d bytes, %v", len(c), len(s), err)
	}
}

func TestKeyLogTwoRandoms(t *testing.T) {
	var k keyLog
	io.WriteString(&k, "CLIENT_TRAFFIC_SECRET_0 01 aa\n")
	io.WriteString(&k, "SERVER_TRAFFIC_SECRET_0 02 bb\n")
	if _, _, err := k.secrets(); err == nil {
		t.Fatal("secrets of two connections were taken for one")
	}
}
