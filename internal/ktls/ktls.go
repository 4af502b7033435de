// Package ktls hands the record layer of a TLS 1.3 connection to the Linux kernel (kernel
// TLS) once crypto/tls has done the handshake, so the data path can use write(2), sendfile
// and splice(2) on a socket that encrypts and decrypts by itself.
//
// crypto/tls stays in charge of the handshake and of every identity check: Client and
// Server return an ordinary *tls.Conn (over a raw connection that Handshake keeps at record
// boundaries) and a Handoff. After Handoff.Handshake, Handoff.Enable derives each
// direction's key and IV from the traffic secrets crypto/tls wrote to its KeyLogWriter
// (RFC 8446 §7.3), installs them with setsockopt(TCP_ULP "tls", SOL_TLS TLS_TX/TLS_RX)
// at record sequence number 0, and returns a *Conn that reads and writes plaintext on the
// raw socket. When it cannot, it returns a *FallbackError whose Reason is one short word
// for an INFO line and a metric label, and the *tls.Conn keeps working: falling back is
// the caller's job.
//
// Sequence numbers, exactly: both directions start at 0, which is right only if no
// application-traffic record was written or read before the switch. Enable checks that
// nothing went through the raw connection after Handshake returned (no application data
// written or read, no KeyUpdate: ReasonUsed otherwise), and the record-exact reads mean
// crypto/tls holds no record past the peer's Finished. Server disables session tickets,
// so a Go server writes no NewSessionTicket; a client may face a server that sends them:
// those records stay in the socket, the kernel decrypts and counts them, and Conn.Read
// drops NewSessionTicket messages. Not handled: TLS 1.2 (refused), a handshake not run
// through Handoff.Handshake (refused), 0-RTT (crypto/tls does not offer it).
//
// What the kernel is not asked to follow: a TLS 1.3 KeyUpdate from the peer. Linux gained
// key updates in 6.14 (the series "tls: implement key updates for TLS1.3", merged into
// net-next in December 2024); before it (the VM's Debian 12 kernel, 6.1, is tested) a
// socket cannot take new RX keys mid-stream, and this package does not try on kernels
// that can (KernelRekeys says which this is). Read reports the KeyUpdate as ErrKeyUpdate,
// other alerts as *RecordError, close_notify as io.EOF, and the caller closes the
// connection. This package never sends KeyUpdate either, so a connection must end before
// RFC 8446 §5.5's per-key limit for AES-GCM (2^24.5 full records, about 390 GB one way).
// Conn.Records gives the kernel's record sequence numbers both ways, by which hbone drains
// a connection well before either limit (hbone/keylimit.go).
//
// Never in FIPS 140-3 mode (crypto/fips140.Enabled): Available and Enable refuse with
// ReasonFIPS, since the kernel's AES-GCM is not the Go Cryptographic Module (errFIPS).
//
// Splicer moves bytes socket → pipe → socket with splice(2), so a payload read from a TCP
// socket reaches a kernel TLS socket (and back) without crossing user space. FillFD,
// DrainFD and DrainN serve callers that wait in their own RawConn callbacks (to hold no
// pipe while idle, or to allocate nothing per frame).
//
// hbone is the user: its Pool and Server ask Available before each handshake, run it
// through Client and Server if the kernel has kernel TLS (over hbone's write-coalescing
// conn, a TCPWrapper, so a later fallback keeps the coalescing), call Enable after the
// ALPN check (Decline instead when the peer may send KeyUpdates), and on a
// *FallbackError carry on with the *tls.Conn and report the Reason; on success they
// frame HTTP/2 over the Conn and splice DATA payloads both ways (hbone/ktls.go).
package ktls

import (
	"bytes"
	"context"
	"crypto/fips140"
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
	"sync"
	"sync/atomic"
)

// Reason says in one word why Enable fell back; it suits a metric label.
type Reason string

const (
	ReasonNoKernelTLS  Reason = "no_kernel_tls"   // setsockopt(TCP_ULP, "tls") failed: no tls module
	ReasonNoHandshake  Reason = "no_handshake"    // Handoff.Handshake did not complete
	ReasonTLSVersion   Reason = "tls_version"     // not TLS 1.3
	ReasonCipher       Reason = "cipher"          // a cipher suite this package has no kernel struct for
	ReasonUsed         Reason = "used"            // crypto/tls read or wrote past the handshake: sequence numbers unknown
	ReasonNoSecrets    Reason = "no_secrets"      // the key log did not give both traffic secrets of this connection
	ReasonKernelKeys   Reason = "kernel_rejected" // TLS_TX or TLS_RX refused (e.g. the kernel lacks that cipher)
	ReasonNotSupported Reason = "unsupported_os"  // not Linux
	ReasonNotTCP       Reason = "not_tcp"         // the connection is neither a *net.TCPConn nor a TCPWrapper
	ReasonFIPS         Reason = "fips"            // FIPS 140-3 mode: records stay with Go's validated module
)

// FallbackError is Enable's error. Unless Unusable is set, the *tls.Conn from Client or
// Server is still good and the caller should carry on with it.
type FallbackError struct {
	Reason Reason
	Err    error // the underlying cause, if any
	// Unusable: TLS_TX was installed but TLS_RX was not, so neither the kernel nor
	// crypto/tls can carry the connection; close it.
	Unusable bool
}

func (e *FallbackError) Error() string {
	if e.Err == nil {
		return "ktls: " + string(e.Reason)
	}
	return "ktls: " + string(e.Reason) + ": " + e.Err.Error()
}

func (e *FallbackError) Unwrap() error { return e.Err }

// ErrKeyUpdate is returned by Conn.Read when the peer sent a TLS 1.3 KeyUpdate: its next
// records are under a key the kernel does not have, so the connection must be closed. It
// is a clean end of the connection, not an attack.
var ErrKeyUpdate = errors.New("ktls: peer sent a TLS 1.3 KeyUpdate, which kernel TLS here cannot follow; close the connection")

// RecordError is a non-application record that ends the connection: an alert other than
// close_notify, or a handshake message other than NewSessionTicket and KeyUpdate.
type RecordError struct {
	Type uint8  // TLS content type: 21 alert, 22 handshake
	Data []byte // the record's plaintext (for an alert: level, description)
}

func (e *RecordError) Error() string {
	if e.Type == recordTypeAlert && len(e.Data) == 2 {
		return fmt.Sprintf("ktls: peer sent alert %d (level %d)", e.Data[1], e.Data[0])
	}
	return fmt.Sprintf("ktls: unexpected record type %d (% x)", e.Type, e.Data)
}

// TLS content types and handshake message types (RFC 8446 §5.1, §4).
const (
	recordTypeAlert           = 21
	recordTypeHandshake       = 22
	recordTypeApplicationData = 23

	typeNewSessionTicket = 4
	typeKeyUpdate        = 24
)

// Handoff carries one connection from crypto/tls's handshake to the kernel.
type Handoff struct {
	tc     *tls.Conn
	raw    *recordConn
	log    *keyLog
	client bool

	handshook       bool
	read, written   int64 // raw bytes at the end of the handshake
	enableAttempted bool
}

// Available reports whether the kernel can take tcp's records, as a *FallbackError
// (ReasonNoKernelTLS, ReasonNotSupported; ReasonFIPS in FIPS 140-3 mode) if not. It installs the TLS ULP (setsockopt
// TCP_ULP "tls"), which without keys leaves the socket plain TCP, so the handshake runs
// as before; Enable then only adds the keys. A caller that asks first runs a connection
// the kernel cannot take through plain crypto/tls from its start, not through Client's
// record-exact reads. tcp must be connected.
func Available(tcp *net.TCPConn) error {
	if fips140.Enabled() {
		return errFIPS
	}
	rc, err := tcp.SyscallConn()
	if err != nil {
		return &FallbackError{Reason: ReasonNoKernelTLS, Err: err}
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = setULP(int(fd)) }); err != nil {
		return &FallbackError{Reason: ReasonNoKernelTLS, Err: err}
	}
	if serr != nil {
		if errors.Is(serr, errors.ErrUnsupported) {
			return &FallbackError{Reason: ReasonNotSupported, Err: serr}
		}
		return &FallbackError{Reason: ReasonNoKernelTLS, Err: fmt.Errorf("setsockopt TCP_ULP tls: %w", serr)}
	}
	return nil
}

// errFIPS is every refusal in FIPS 140-3 mode (crypto/fips140.Enabled). Kernel TLS would
// take each connection's traffic keys out of the Go Cryptographic Module, through the key
// log, and encrypt its records with the kernel's AES-GCM, which is not that module: the
// records of a FIPS node are sealed by the validated module or not at all.
var errFIPS = &FallbackError{Reason: ReasonFIPS, Err: errors.New("FIPS 140-3 mode keeps TLS records in Go's cryptographic module")}

// TCPWrapper is a connection over a *net.TCPConn (TCP returns it) whose Read and Write
// go straight to that socket until Enable has returned; after a fallback its writes may
// be buffered. Client and Server accept one, so a caller can keep its own LocalAddr, or
// coalesce crypto/tls's records if the connection stays on crypto/tls.
type TCPWrapper interface {
	net.Conn
	TCP() *net.TCPConn
}

// Client is tls.Client over conn (a *net.TCPConn or a TCPWrapper), prepared for Enable:
// cfg is cloned and its KeyLogWriter chained (a writer already there still gets every
// line).
func Client(conn net.Conn, cfg *tls.Config) (*tls.Conn, *Handoff) {
	return prepare(conn, cfg, true)
}

// Server is tls.Server over conn (a *net.TCPConn or a TCPWrapper), prepared for Enable:
// cfg is cloned, its KeyLogWriter chained, and session tickets disabled (a
// NewSessionTicket written before the switch would shift the sequence number of every
// record the kernel sends).
func Server(conn net.Conn, cfg *tls.Config) (*tls.Conn, *Handoff) {
	return prepare(conn, cfg, false)
}

func prepare(conn net.Conn, cfg *tls.Config, client bool) (*tls.Conn, *Handoff) {
	cfg = cfg.Clone()
	kl := &keyLog{next: cfg.KeyLogWriter}
	cfg.KeyLogWriter = kl
	raw := &recordConn{Conn: conn}
	switch c := conn.(type) {
	case *net.TCPConn:
		raw.tcp = c
	case TCPWrapper:
		raw.tcp = c.TCP()
	}
	h := &Handoff{raw: raw, log: kl, client: client}
	if client {
		h.tc = tls.Client(raw, cfg)
	} else {
		cfg.SessionTicketsDisabled = true
		if inner := cfg.GetConfigForClient; inner != nil {
			// The config it returns runs the handshake: it needs the key log too.
			cfg.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
				c, err := inner(hello)
				if c == nil || err != nil {
					return c, err
				}
				c = c.Clone()
				c.SessionTicketsDisabled = true
				c.KeyLogWriter = &keyLogTee{kl, c.KeyLogWriter}
				return c, nil
			}
		}
		h.tc = tls.Server(raw, cfg)
	}
	return h.tc, h
}

// keyLogTee is the key log of a config that GetConfigForClient returned: its own
// writer, if any, gets every line as well.
type keyLogTee struct {
	kl   *keyLog
	next io.Writer
}

func (t *keyLogTee) Write(line []byte) (int, error) {
	if t.next != nil {
		_, _ = t.next.Write(line)
	}
	return t.kl.Write(line)
}

// Handshake runs the TLS handshake (the *tls.Conn's HandshakeContext) and notes where it
// ended, so Enable can tell whether anything was read or written after it. Call it
// instead of the *tls.Conn's Handshake; a *tls.Conn that handshakes implicitly (on its
// first Read or Write) falls back with ReasonNoHandshake.
func (h *Handoff) Handshake(ctx context.Context) error {
	if err := h.tc.HandshakeContext(ctx); err != nil {
		h.raw.mode.Store(modePass)
		return err
	}
	h.handshook = true
	h.read, h.written = h.raw.nread.Load(), h.raw.nwritten.Load()
	return nil
}

// Enable switches the connection to kernel TLS (never in FIPS 140-3 mode). On success the *tls.Conn must be neither
// used (its raw connection refuses I/O) nor closed: the returned Conn owns the socket. On a
// *FallbackError the *tls.Conn carries on (unless Unusable), now with plain reads.
func (h *Handoff) Enable() (*Conn, error) {
	if h.enableAttempted {
		return nil, errors.New("ktls: Enable called twice, or after Decline")
	}
	h.enableAttempted = true
	if fips140.Enabled() {
		h.raw.mode.Store(modePass)
		return nil, errFIPS
	}
	keys, ferr := h.keys()
	if ferr != nil {
		h.raw.mode.Store(modePass)
		return nil, ferr
	}
	defer keys.clear()
	// No crypto/tls I/O may race the switch: the handshake is over and nothing went
	// through raw since (checked in keys), so marking raw gone here is in order.
	h.raw.mode.Store(modeGone)
	if h.raw.tcp == nil {
		h.raw.mode.Store(modePass)
		return nil, &FallbackError{Reason: ReasonNotTCP}
	}
	c, err := enable(h.raw.tcp, keys, h.tc.ConnectionState())
	if err != nil {
		var fe *FallbackError
		if errors.As(err, &fe) && !fe.Unusable {
			h.raw.mode.Store(modePass)
		}
		return nil, err
	}
	return c, nil
}

// Decline keeps the connection in crypto/tls for good, as a caller does that will not
// call Enable (hbone, for a peer that may send KeyUpdates): from now on the raw connection
// reads as much as crypto/tls asks for, not one record at a time, which would cost a
// read(2) for each record's header and another for its body. Call it after Handshake and
// before the *tls.Conn reads again; Enable fails after it.
func (h *Handoff) Decline() {
	h.enableAttempted = true
	h.raw.mode.Store(modePass)
}

// keys checks that the connection can be switched and derives its keys.
func (h *Handoff) keys() (*trafficKeys, *FallbackError) {
	st := h.tc.ConnectionState()
	if !h.handshook || !st.HandshakeComplete {
		return nil, &FallbackError{Reason: ReasonNoHandshake}
	}
	if st.Version != tls.VersionTLS13 {
		return nil, &FallbackError{Reason: ReasonTLSVersion, Err: fmt.Errorf("version %s", tls.VersionName(st.Version))}
	}
	s, ok := suiteOf(st.CipherSuite)
	if !ok {
		return nil, &FallbackError{Reason: ReasonCipher, Err: errors.New(tls.CipherSuiteName(st.CipherSuite))}
	}
	if r, w := h.raw.nread.Load(), h.raw.nwritten.Load(); r != h.read || w != h.written {
		return nil, &FallbackError{Reason: ReasonUsed, Err: fmt.Errorf("%d bytes read and %d written after the handshake", r-h.read, w-h.written)}
	}
	clientSecret, serverSecret, err := h.log.secrets()
	if err != nil {
		return nil, &FallbackError{Reason: ReasonNoSecrets, Err: err}
	}
	tx, rx := clientSecret, serverSecret
	if !h.client {
		tx, rx = serverSecret, clientSecret
	}
	k := &trafficKeys{suite: s}
	if k.txKey, k.txIV, err = deriveKeys(s, tx); err == nil {
		k.rxKey, k.rxIV, err = deriveKeys(s, rx)
	}
	clear(clientSecret)
	clear(serverSecret)
	if err != nil {
		return nil, &FallbackError{Reason: ReasonCipher, Err: err}
	}
	return k, nil
}

// suite is what the kernel and the key schedule need of a TLS 1.3 cipher suite.
type suite struct {
	kernelCipher uint16 // TLS_CIPHER_* of linux/tls.h
	keyLen       int
	hash         func() hash.Hash
}

// Values from include/uapi/linux/tls.h.
const (
	tlsCipherAESGCM128        = 51
	tlsCipherAESGCM256        = 52
	tlsCipherChaCha20Poly1305 = 54
)

func suiteOf(id uint16) (suite, bool) {
	switch id {
	case tls.TLS_AES_128_GCM_SHA256:
		return suite{tlsCipherAESGCM128, 16, sha256.New}, true
	case tls.TLS_AES_256_GCM_SHA384:
		return suite{tlsCipherAESGCM256, 32, sha512.New384}, true
	case tls.TLS_CHACHA20_POLY1305_SHA256:
		return suite{tlsCipherChaCha20Poly1305, 32, sha256.New}, true
	}
	return suite{}, false
}

// trafficKeys are both directions' write keys and IVs.
type trafficKeys struct {
	suite       suite
	txKey, txIV []byte
	rxKey, rxIV []byte
}

func (k *trafficKeys) clear() {
	clear(k.txKey)
	clear(k.txIV)
	clear(k.rxKey)
	clear(k.rxIV)
}

// deriveKeys is RFC 8446 §7.3: key = HKDF-Expand-Label(secret, "key", "", key_length),
// iv = HKDF-Expand-Label(secret, "iv", "", 12).
func deriveKeys(s suite, secret []byte) (key, iv []byte, err error) {
	if len(secret) != s.hash().Size() {
		return nil, nil, fmt.Errorf("traffic secret of %d bytes for a %d-byte hash", len(secret), s.hash().Size())
	}
	if key, err = hkdf.Expand(s.hash, secret, expandLabelInfo("key", s.keyLen), s.keyLen); err != nil {
		return nil, nil, err
	}
	if iv, err = hkdf.Expand(s.hash, secret, expandLabelInfo("iv", 12), 12); err != nil {
		return nil, nil, err
	}
	return key, iv, nil
}

// expandLabelInfo is the HkdfLabel struct of RFC 8446 §7.1 with an empty context:
// uint16 length, opaque label<7..255> = "tls13 " + label, opaque context<0..255> = "".
func expandLabelInfo(label string, length int) string {
	b := binary.BigEndian.AppendUint16(nil, uint16(length))
	b = append(b, byte(len("tls13 ")+len(label)))
	b = append(b, "tls13 "...)
	b = append(b, label...)
	return string(append(b, 0))
}

// keyLog is the KeyLogWriter of one connection: it keeps that connection's two traffic
// secrets (NSS key log format, "LABEL <client random hex> <secret hex>") and passes every
// line on to the writer the caller had configured.
type keyLog struct {
	next io.Writer

	mu             sync.Mutex
	random         []byte
	client, server []byte
	err            error
}

func (k *keyLog) Write(line []byte) (int, error) {
	if k.next != nil {
		_, _ = k.next.Write(line) // a debugging aid's failure must not fail the handshake
	}
	f := bytes.Fields(line)
	if len(f) != 3 {
		return len(line), nil
	}
	var dst *[]byte
	switch string(f[0]) {
	case "CLIENT_TRAFFIC_SECRET_0":
		dst = &k.client
	case "SERVER_TRAFFIC_SECRET_0":
		dst = &k.server
	default:
		return len(line), nil
	}
	random, err1 := hex.DecodeString(string(f[1]))
	secret, err2 := hex.DecodeString(string(f[2]))
	k.mu.Lock()
	defer k.mu.Unlock()
	switch {
	case err1 != nil || err2 != nil:
		k.err = errors.New("unparsable key log line")
	case k.random != nil && !bytes.Equal(k.random, random):
		// One config per connection, so this means a second handshake on it.
		k.err = errors.New("key log lines of two client randoms")
	default:
		k.random = random
		*dst = secret
	}
	return len(line), nil
}

// secrets returns the client and server application traffic secrets, and forgets them.
func (k *keyLog) secrets() (client, server []byte, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	client, server = k.client, k.server
	k.client, k.server = nil, nil
	switch {
	case k.err != nil:
		return nil, nil, k.err
	case client == nil || server == nil:
		return nil, nil, errors.New("no CLIENT_TRAFFIC_SECRET_0 and SERVER_TRAFFIC_SECRET_0 in the key log")
	}
	return client, server, nil
}

// recordConn modes.
const (
	modeExact int32 = iota // hand crypto/tls one record at a time
	modePass               // plain reads: the connection stays on crypto/tls
	modeGone               // handed to the kernel: crypto/tls must not touch the socket
)

var errHandedOff = errors.New("ktls: connection handed to kernel TLS; use the ktls.Conn")

// recordConn is the raw connection under crypto/tls. Until the switch it returns at most
// the rest of the current TLS record from each Read (a 5-byte header, then its body), so
// crypto/tls never reads ahead of the record it is working on, and it counts what passes
// through, so Enable can tell whether crypto/tls read or wrote after the handshake.
type recordConn struct {
	net.Conn
	tcp             *net.TCPConn // the socket under Conn, nil if there is none
	mode            atomic.Int32
	nread, nwritten atomic.Int64
	hdr             [5]byte // the current record's header (crypto/tls's reader only)
	nhdr            int     // header bytes read so far
	body            int     // body bytes of the current record still to read
}

func (c *recordConn) Read(p []byte) (int, error) {
	switch c.mode.Load() {
	case modeGone:
		return 0, errHandedOff
	case modePass:
		n, err := c.Conn.Read(p)
		c.nread.Add(int64(n))
		return n, err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if c.nhdr < len(c.hdr) {
		n, err := c.Conn.Read(p[:min(len(p), len(c.hdr)-c.nhdr)])
		copy(c.hdr[c.nhdr:], p[:n])
		c.nhdr += n
		if c.nhdr == len(c.hdr) {
			c.body = int(binary.BigEndian.Uint16(c.hdr[3:]))
			if c.body == 0 {
				c.nhdr = 0
			}
		}
		c.nread.Add(int64(n))
		return n, err
	}
	n, err := c.Conn.Read(p[:min(len(p), c.body)])
	c.body -= n
	if c.body == 0 {
		c.nhdr = 0
	}
	c.nread.Add(int64(n))
	return n, err
}

func (c *recordConn) Write(p []byte) (int, error) {
	if c.mode.Load() == modeGone {
		return 0, errHandedOff
	}
	n, err := c.Conn.Write(p)
	c.nwritten.Add(int64(n))
	return n, err
}
