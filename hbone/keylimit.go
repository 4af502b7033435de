package hbone

// Key limits: a connection drains before its TLS keys reach a record limit it cannot
// rekey past, so no stream is lost to a KeyUpdate or to RFC 8446 §5.5's limit.
//
//   - Sent records: crypto/tls never sends a KeyUpdate of its own (it only answers a
//     peer's update_requested), nor does kernel TLS here, so without this a connection
//     would pass the per-key limit on AES-GCM (2^24.5 full records) on every path.
//   - Received records, under kernel TLS: the kernel here follows no KeyUpdate (Linux
//     gained that in 6.14), and rustls (the Rust ztunnel's TLS) sends one when its write
//     sequence reaches its confidentiality limit, 2^23 records on AES-256-GCM and 2^24 on
//     AES-128-GCM. Such peers negotiate "h2" and stay on the user-space path, where
//     crypto/tls follows the KeyUpdate (ktls.go, NextProtoNoKeyUpdate); a kernel TLS
//     connection's peer promised no KeyUpdate, and the count guards against one that
//     breaks it. Received records are also counted on TLS 1.2, which has no KeyUpdate
//     (rustls closes the connection there instead).
//
// Sent records are counted per key. crypto/tls's one KeyUpdate, its answer to a peer's
// update_requested (which leaves at once: bufConn writes through when the write lock is
// not held), puts the records after it under a fresh key, and the count restarts there
// (sendKeys tells that record from application data); a peer's KeyUpdate without
// update_requested renews only the peer's key. Received records, counted only where no
// KeyUpdate is followed, and the first key's sent records run from the connection's
// first record (on the user-space path the handshake's few are in them).
//
// Once either count reaches KeyDrainRecords (by default half the rustls limit, so the
// peer's KeyUpdate is far off) the connection drains: a server sends GOAWAY(NO_ERROR), a
// client stops putting new streams on it, and new streams go to a fresh connection while
// the open ones finish. A stream that outlives the drain by as much again fails loudly
// rather than silently: at KeyMaxRecords sent (2^24.5) the connection is closed, and at
// the peer's KeyUpdate under kernel TLS it ends (ktls.ErrKeyUpdate); either way each
// stream's reads and writes fail with ErrConnClosed, which the proxy passes on to its
// TCP peer as a reset, never as a FIN, and Config.OnKeyLimit hears of it.

import (
	"crypto/tls"
	"errors"
	"sync/atomic"
)

// Record limits by cipher suite (see the file comment).
const (
	// aesGCMMaxRecords is RFC 8446 §5.5's limit for AES-GCM: 2^24.5 full-size records.
	aesGCMMaxRecords = 23726566
	// rustls's confidentiality_limit, where it sends a KeyUpdate.
	rustlsAES128Limit = 1 << 24
	rustlsAES256Limit = 1 << 23
)

// kernelKeyCheckEvery is how many frames the frame reader reads between two looks at a
// kernel TLS connection's record counts (a getsockopt(2) each): at most a few hundred
// records pass between them, against limits in the millions.
const kernelKeyCheckEvery = 16

// errKeyLimit closes a connection that reached KeyMaxRecords with streams still open.
var errKeyLimit = errors.New("hbone: TLS key reached its record limit (RFC 8446 §5.5) with streams still open after the drain")

// KeyLimit is what Config.OnKeyLimit hears of one connection.
type KeyLimit struct {
	// Event: "drain" (the connection reached KeyDrainRecords and drains), "tx_limit"
	// (closed at KeyMaxRecords) or "peer_key_update" (the peer's KeyUpdate ended a
	// kernel TLS connection).
	Event   string
	Streams int    // streams open at that moment: for a close, the streams that failed
	TX, RX  uint64 // records sent and received under the connection's current keys (RX: 0 when not counted)
	Kernel  bool   // the connection runs in kernel TLS
	Server  bool
}

// keyLimits is a connection's record limits; the frame reader's alone after newConn.
type keyLimits struct {
	drainAt uint64 // either direction's records at which to drain; 0: never
	maxTX   uint64 // sent records at which to close; 0: never
	countRX bool   // received records count: kernel TLS, or TLS 1.2
	since   uint8  // frames since the last look (kernel TLS)
	drained bool
	lastTX  uint64 // the counts at the last look
	lastRX  uint64
}

// suiteLimits returns the default drain point and hard limit of a cipher suite.
func suiteLimits(suite uint16) (drain, max uint64) {
	switch suite {
	case tls.TLS_AES_128_GCM_SHA256,
		tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256:
		return rustlsAES128Limit / 2, aesGCMMaxRecords
	case tls.TLS_AES_256_GCM_SHA384,
		tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384:
		return rustlsAES256Limit / 2, aesGCMMaxRecords
	}
	// ChaCha20-Poly1305: no practical limit (RFC 8446 §5.5), and rustls sets none.
	return 0, 0
}

// setKeyLimits fills c.keys from the handshake and the Config; called by newConn.
func (c *conn) setKeyLimits() {
	k := &c.keys
	counted := c.kt.conn != nil || c.bc != nil && c.bc.count
	if !counted || c.tls.Version == 0 {
		return // a caller-made *tls.Conn (ServeConn) or h2c: nothing to count
	}
	drain, maxTX := suiteLimits(c.tls.CipherSuite)
	k.drainAt = limitOf(c.cfg.KeyDrainRecords, drain)
	k.maxTX = limitOf(c.cfg.KeyMaxRecords, maxTX)
	k.countRX = c.kt.conn != nil || c.tls.Version < tls.VersionTLS13
}

// limitOf is a Config value: zero is def, negative is off (0).
func limitOf(v int64, def uint64) uint64 {
	switch {
	case v == 0:
		return def
	case v < 0:
		return 0
	}
	return uint64(v)
}

// records returns the records sent and received so far under the connection's current
// keys.
func (c *conn) records() (tx, rx uint64, err error) {
	if c.kt.conn != nil {
		return c.kt.conn.Records()
	}
	var start uint64
	if k := c.bc.tx.keys; k != nil {
		start = k.start.Load() // before n: a KeyUpdate in between would make it pass n
	}
	return c.bc.tx.n.Load() - start, c.bc.rx.n.Load(), nil
}

// sendKeys finds, among the records crypto/tls sends after a TLS 1.3 handshake, its
// KeyUpdates (answers to the peer's update_requested, the only ones it sends), so that
// the sent count restarts with each key. The records are encrypted, but their lengths
// tell: a KeyUpdate is a 5-byte message, so a record of 5 bytes of plaintext, and an
// application record that short can only be the tail of a Write that crypto/tls cut into
// records, whose others went out just before it under crypto/tls's write lock. A
// KeyUpdate is written under that lock too, so never inside a Write. conn.writing tells
// pending of each Write that may be cut before crypto/tls takes it, and each record of
// it takes its plaintext off again: a 5-byte record while pending is not exactly 5 is a
// KeyUpdate. (crypto/tls cuts a Write into records of a TCP segment's payload or more,
// and a tail; the Writes not told are frames of 33 bytes at most, one record each.)
type sendKeys struct {
	pending atomic.Int64  // bytes of the Write in crypto/tls not yet seen in a record
	start   atomic.Uint64 // records sent before the current key's first
}

// TLS 1.3 record sizes: every record carries its content type and a 16-byte AEAD tag
// (crypto/tls adds no padding); a KeyUpdate message is type, 3-byte length, request.
const (
	tls13RecordOverhead = 1 + 16
	keyUpdateMsgLen     = 5
)

// record is told of the n-th record sent, of body bytes (recordCounter.add, under
// crypto/tls's write lock).
func (k *sendKeys) record(body int, n uint64) {
	plain, pending := int64(body-tls13RecordOverhead), k.pending.Load()
	if plain == keyUpdateMsgLen && pending != keyUpdateMsgLen {
		k.start.Store(n) // this record is the old key's last
		return
	}
	if pending > 0 {
		k.pending.Add(-plain)
	}
}

// writing tells sendKeys that the next Write to crypto/tls, of n bytes, may be cut into
// several records (wmu held). It is not a wrapper around the Write: a frame more under
// it would double the stack of an idle connection's copy goroutine to 8 KiB
// (proxy's TestIdleConnectionStacks).
func (c *conn) writing(n int) {
	if c.bc != nil && c.bc.tx.keys != nil {
		c.bc.tx.keys.pending.Add(int64(n))
	}
}

// checkKeys is the frame reader's look at the record counts after each frame. It drains
// the connection at the drain point and returns errKeyLimit at the hard limit.
func (c *conn) checkKeys() error {
	k := &c.keys
	if k.drainAt == 0 && k.maxTX == 0 {
		return nil
	}
	if c.kt.conn != nil {
		if k.since++; k.since < kernelKeyCheckEvery {
			return nil
		}
		k.since = 0
	}
	tx, rx, err := c.records()
	if err != nil {
		// Not expected on a kernel with kernel TLS (getsockopt TLS_TX/TLS_RX exist since
		// 4.x); without counts the limits cannot be kept.
		k.drainAt, k.maxTX = 0, 0
		return nil
	}
	if !k.countRX {
		rx = 0
	}
	k.lastTX, k.lastRX = tx, rx
	if k.maxTX > 0 && tx >= k.maxTX {
		c.keyEvent("tx_limit")
		return errKeyLimit
	}
	if !k.drained && k.drainAt > 0 && max(tx, rx) >= k.drainAt {
		k.drained = true
		c.keyEvent("drain")
		c.drainForKeys()
	}
	return nil
}

// drainForKeys takes no new streams on c: a server sends GOAWAY(NO_ERROR), a client
// leaves the pool (as on a GOAWAY received). Either closes once its streams have ended.
func (c *conn) drainForKeys() {
	if c.server {
		c.startDrain()
		return
	}
	c.mu.Lock()
	c.goaway = true
	if c.active == 0 && c.reserved == 0 {
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
	c.mu.Unlock()
	c.leavePool()
}

// keyEvent tells Config.OnKeyLimit.
func (c *conn) keyEvent(event string) {
	if c.cfg.OnKeyLimit == nil {
		return
	}
	c.mu.Lock()
	n := c.active
	c.mu.Unlock()
	c.cfg.OnKeyLimit(KeyLimit{Event: event, Streams: n, TX: c.keys.lastTX, RX: c.keys.lastRX,
		Kernel: c.kt.conn != nil, Server: c.server})
}
