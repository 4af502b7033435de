package hbone

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/gozt/gozt/identity"
)

// Config holds what both sides of a connection use: the HTTP/2 windows and frame size, the
// keepalive, kernel TLS, the TLS key limits, and the hooks that report on them. A Pool
// takes a ClientConfig and a Server a ServerConfig, each embedding a Config, as
// x/net/http2 keeps a Transport's knobs apart from a Server's; what only a Server budgets
// across its connections is its AdmissionConfig. The zero value means the defaults in
// brackets, which are the Rust ztunnel's.
type Config struct {
	StreamWindow uint32        // [4 MiB] initial stream flow-control window we advertise
	ConnWindow   uint32        // [16 MiB] connection window we advertise
	MaxFrameSize uint32        // [1 MiB] SETTINGS_MAX_FRAME_SIZE we accept
	PingInterval time.Duration // [10s]
	PingTimeout  time.Duration // [20s] no PING ack within this -> connection dropped
	DialTimeout  time.Duration // [10s] client: a Dial as a whole (TCP, TLS, SETTINGS, the CONNECT answer); a dial's timeout error says "maybe a NetworkPolicy is blocking HBONE port 15008"; server: TLS handshake and preface
	// OnDrop, if set, is told of every stream dropped before it reached a handler's
	// answer, of every connection closed for abuse (on either side), and of every
	// connection or stream a per-node budget refused or delayed (limits.go,
	// admission.go). It runs on the connection's frame reader, serving goroutine or
	// handler goroutine: it must be quick and must not block.
	OnDrop func(DropReason)
	// DisableKernelTLS keeps every connection's TLS records in crypto/tls. By default the
	// connections this package runs the handshake of (Pool's, ServeTLS's) hand the record
	// layer to the Linux kernel after the handshake when the kernel can take it, and carry
	// on in crypto/tls when it cannot (ktls.go).
	DisableKernelTLS bool
	// OnTLS, if set, is told once per such connection, after its handshake and before it
	// carries HTTP/2, where its TLS records are handled. It runs on the dialing or serving
	// goroutine; it must not block.
	OnTLS func(TLSInfo)
	// OnKernelTLSEnd, if set, is told when a kernel TLS connection ends how many DATA
	// payload bytes it spliced (never in user space) and copied, each way.
	OnKernelTLSEnd func(KernelTLSBytes)
	// Key limits (keylimit.go) of the connections this package runs the handshake of:
	// zero means the default in brackets, a negative value turns the limit off.
	// KeyDrainRecords: once a connection has sent, or (under kernel TLS, or on TLS 1.2)
	// received, this many TLS records under one key, it drains: new streams go to a fresh
	// connection, the open ones finish. [half the record count at which rustls sends a
	// KeyUpdate: 2^22 on AES-256-GCM, 2^23 on AES-128-GCM; off on ChaCha20-Poly1305]
	KeyDrainRecords int64
	// KeyMaxRecords: a connection that has sent this many records under one key is closed,
	// its remaining streams failing. [RFC 8446 §5.5's AES-GCM limit, 2^24.5 = 23726566;
	// off on ChaCha20-Poly1305]
	KeyMaxRecords int64
	// OnKeyLimit, if set, is told when a connection drains for its key's record limit,
	// and when one ends at a limit or at the peer's KeyUpdate under kernel TLS. It runs on
	// the frame reader; it must not block.
	OnKeyLimit func(KeyLimit)
}

// ClientConfig is a Pool's configuration: the connection's Config and how the pool dials
// and shares its connections.
type ClientConfig struct {
	Config
	MaxStreamsPerConn int           // [100] streams per pooled connection (min with peer's MAX_CONCURRENT_STREAMS)
	IdleTimeout       time.Duration // [5m] pooled connection with no streams leaves the pool
	// Control is applied to dialed sockets (SO_MARK etc.); optional.
	Control func(network, address string, c syscall.RawConn) error
	// Dial, if set, opens the TCP connection under each pooled connection with d (which
	// carries Control and the local address) instead of d.DialContext: in-pod mode dials
	// from inside the pod's network namespace this way.
	Dial func(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error)
}

// ServerConfig is a Server's configuration: the connection's Config, what one connection
// may carry, and the Server's admission budgets across its connections.
type ServerConfig struct {
	Config
	MaxConcurrentStreams uint32 // [200] SETTINGS_MAX_CONCURRENT_STREAMS advertised
	MaxHandshakes        int    // [1024] TLS handshakes in flight; past it the oldest is dropped (admit.go)
	Admission            AdmissionConfig
}

// AdmissionConfig holds a Server's per-node budgets across its connections (admission.go
// says why each is what it is): zero means the default in brackets, a negative value
// turns the budget off.
type AdmissionConfig struct {
	HandshakeWorkers       int     // [GOMAXPROCS-1, at least 1] ServeTLS handshakes computing at once
	SourceHandshakes       int     // [256] handshakes in flight from one source IP; past it a new connection is refused
	SourceHandshakeRate    float64 // [32/s, burst 8 s of it] new connections from one source IP, a successful handshake's given back; past it one waits up to 1 s, then is refused
	SourceFailedHandshakes float64 // [2/s, burst 8 s of it] failed handshakes of one source IP; past it its connections are refused before TLS
	PeerConnRate           float64 // [32/s, burst 4 s of it] new HBONE connections of one peer identity; past it one waits up to 1 s, then is closed
	PeerStreams            int     // [16384] open streams of one peer identity; past it a new one gets REFUSED_STREAM
	PeerDials              int     // [256] streams of one peer identity whose handler has not answered; past it a new one waits
	StreamStarts           float64 // [64/s, burst ¼ s of it] handlers started for one connection's streams, each given back once its stream carries a byte or ends; past it a new stream waits without a goroutine
	// SourceRelays, if set, names source IPs that relay other clients' connections (a
	// network gateway forwarding double HBONE): no per-source budget applies to them, nor
	// PeerConnRate (a connection per proxied connection there); the other per-identity
	// budgets do, each client having its own identity.
	SourceRelays func(netip.Addr) bool
}

// connConfig is what one connection reads of its Pool's or Server's configuration: the
// shared Config and its own side's fields (the other side's stay zero).
type connConfig struct {
	Config
	MaxStreamsPerConn    int           // client
	IdleTimeout          time.Duration // client
	MaxConcurrentStreams uint32        // server
	StreamStarts         float64       // server
	PeerStreams          int           // server
}

func (c ClientConfig) conn() connConfig {
	return connConfig{Config: c.Config, MaxStreamsPerConn: c.MaxStreamsPerConn, IdleTimeout: c.IdleTimeout}
}

func (c ServerConfig) conn() connConfig {
	return connConfig{Config: c.Config, MaxConcurrentStreams: c.MaxConcurrentStreams,
		StreamStarts: c.Admission.StreamStarts, PeerStreams: c.Admission.PeerStreams}
}

// TLSInfo is what Config.OnTLS hears of one connection.
type TLSInfo struct {
	Kernel bool // the kernel encrypts and decrypts its records
	// Reason says why not, in one word fit for a metric label: a ktls.Reason
	// (no_kernel_tls, cipher, ...), "disabled" (DisableKernelTLS) or "not_tcp".
	Reason string
	Err    error // the fallback's cause, if any
	Server bool  // the connection was accepted, not dialed
}

// KernelTLSBytes counts one kernel TLS connection's DATA payload bytes by path.
type KernelTLSBytes struct {
	SplicedOut, CopiedOut int64 // sent: socket → pipe → kernel TLS, or through a user-space buffer
	SplicedIn, CopiedIn   int64 // received
}

// DropReason says why a stream or connection was dropped.
type DropReason uint8

const (
	// DropRefused: a new stream beyond MAX_CONCURRENT_STREAMS (or while draining) got
	// RST_STREAM(REFUSED_STREAM).
	DropRefused DropReason = iota
	// DropResetUnanswered: the peer reset a stream before the handler answered it.
	DropResetUnanswered
	// DropConnCalm: a connection was closed with GOAWAY(ENHANCE_YOUR_CALM).
	DropConnCalm
	// DropHandshakeEvicted: a connection still in its TLS handshake was closed to make
	// room for a new one past MaxHandshakes.
	DropHandshakeEvicted
	// DropSourceHandshakes: a connection was refused before TLS because its source IP
	// had SourceHandshakes in flight.
	DropSourceHandshakes
	// DropSourceRate: a connection was refused before TLS because its source IP was past
	// SourceHandshakeRate.
	DropSourceRate
	// DropSourceFailures: a connection was refused before TLS because its source IP was
	// past SourceFailedHandshakes.
	DropSourceFailures
	// DropPeerConnRate: a connection was closed after its handshake because its peer
	// identity was past PeerConnRate.
	DropPeerConnRate
	// DropPeerStreams: a new stream got RST_STREAM(REFUSED_STREAM) because its peer
	// identity had PeerStreams open.
	DropPeerStreams
	// DropPeerDials: a new stream waited because its peer identity had PeerDials
	// streams unanswered (it was delayed, not dropped).
	DropPeerDials
	// DropStreamStarts: a new stream waited for its handler because its connection was
	// past StreamStarts (it was delayed, not dropped).
	DropStreamStarts

	// NumDropReasons is one more than the last DropReason.
	NumDropReasons
)

func (r DropReason) String() string {
	switch r {
	case DropRefused:
		return "refused"
	case DropResetUnanswered:
		return "reset_unanswered"
	case DropConnCalm:
		return "enhance_your_calm"
	case DropHandshakeEvicted:
		return "handshake_evicted"
	case DropSourceHandshakes:
		return "source_handshakes"
	case DropSourceRate:
		return "source_handshake_rate"
	case DropSourceFailures:
		return "source_failed_handshakes"
	case DropPeerConnRate:
		return "peer_connection_rate"
	case DropPeerStreams:
		return "peer_streams"
	case DropPeerDials:
		return "peer_dials_waited"
	case DropStreamStarts:
		return "stream_starts_waited"
	}
	return "unknown"
}

const (
	maxWindow         = 1<<31 - 1
	minFrameSize      = 16384
	maxFrameSizeLimit = 1<<24 - 1
	clientMaxHeaders  = 16 << 10
	serverMaxHeaders  = 64 << 10
)

// withDefaults fills zero fields and clamps values to what RFC 9113 allows.
func (c Config) withDefaults() Config {
	if c.StreamWindow == 0 {
		c.StreamWindow = 4 << 20
	}
	if c.ConnWindow == 0 {
		c.ConnWindow = 16 << 20
	}
	c.StreamWindow = min(c.StreamWindow, maxWindow)
	c.ConnWindow = min(max(c.ConnWindow, 65535), maxWindow)
	if c.MaxFrameSize == 0 {
		c.MaxFrameSize = 1 << 20
	}
	c.MaxFrameSize = min(max(c.MaxFrameSize, minFrameSize), maxFrameSizeLimit)
	if c.PingInterval <= 0 {
		c.PingInterval = 10 * time.Second
	}
	if c.PingTimeout <= 0 {
		c.PingTimeout = 20 * time.Second
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 10 * time.Second
	}
	return c
}

func (c ClientConfig) withDefaults() ClientConfig {
	c.Config = c.Config.withDefaults()
	if c.MaxStreamsPerConn <= 0 {
		c.MaxStreamsPerConn = 100
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 5 * time.Minute
	}
	return c
}

func (c ServerConfig) withDefaults() ServerConfig {
	c.Config = c.Config.withDefaults()
	if c.MaxConcurrentStreams == 0 {
		c.MaxConcurrentStreams = 200
	}
	if c.MaxHandshakes <= 0 {
		c.MaxHandshakes = 1024
	}
	c.Admission = c.Admission.withDefaults()
	return c
}

func (c AdmissionConfig) withDefaults() AdmissionConfig {
	if c.HandshakeWorkers == 0 {
		c.HandshakeWorkers = handshakeWorkers()
	}
	c.SourceHandshakes = defaultInt(c.SourceHandshakes, 256)
	c.SourceHandshakeRate = defaultRate(c.SourceHandshakeRate, 32)
	c.SourceFailedHandshakes = defaultRate(c.SourceFailedHandshakes, 2)
	c.PeerConnRate = defaultRate(c.PeerConnRate, 32)
	c.PeerStreams = defaultInt(c.PeerStreams, 16384)
	c.PeerDials = defaultInt(c.PeerDials, 256)
	c.StreamStarts = defaultRate(c.StreamStarts, 64)
	return c
}

// defaultInt is v, or def for zero, or 0 (off) for a negative v.
func defaultInt(v, def int) int {
	if v == 0 {
		return def
	}
	return max(v, 0)
}

// defaultRate is defaultInt for rates.
func defaultRate(v, def float64) float64 {
	if v == 0 {
		return def
	}
	return max(v, 0)
}

// Key identifies a pool of connections. It is comparable so it can key a map; two
// requests share connections only when every field matches.
type Key struct {
	Src   identity.ID    // our identity: the client certificate presented
	Peers string         // canonical (sorted, deduplicated, comma-joined) expected peer IDs
	Addr  netip.AddrPort // peer's HBONE address (usually port 15008)
	SrcIP netip.Addr     // local address to bind, if valid
}

// NewKey builds a Key, canonicalising the expected identities so that the same set in any
// order lands in the same pool.
func NewKey(src identity.ID, expected []identity.ID, addr netip.AddrPort, srcIP netip.Addr) Key {
	ids := make([]string, 0, len(expected))
	for _, id := range expected {
		if !id.IsZero() {
			ids = append(ids, id.String())
		}
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	return Key{Src: src, Peers: strings.Join(ids, ","), Addr: addr, SrcIP: srcIP}
}

// Expected returns the expected peer identities encoded in Peers.
func (k Key) Expected() []identity.ID {
	if k.Peers == "" {
		return nil
	}
	parts := strings.Split(k.Peers, ",")
	out := make([]identity.ID, 0, len(parts))
	for _, p := range parts {
		if id, err := identity.Parse(p); err == nil {
			out = append(out, id)
		}
	}
	return out
}
