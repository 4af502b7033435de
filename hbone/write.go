package hbone

// The write side: frames go out under the write lock (conn.wmu), control frames the
// reader owes are queued for writeLoop, and bufConn is flushed by the last writer out.

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// writePreface sends our connection preface: (client magic), SETTINGS and the
// connection-window increase.
func (c *conn) writePreface() error {
	c.lockWrite()
	defer c.unlockWrite()
	if !c.server {
		if _, err := io.WriteString(c.nc, http2.ClientPreface); err != nil {
			return err
		}
	}
	st := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: c.cfg.StreamWindow},
		{ID: http2.SettingMaxFrameSize, Val: c.cfg.MaxFrameSize},
	}
	if c.server {
		st = append(st, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: c.cfg.MaxConcurrentStreams},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: serverMaxHeaders})
	} else {
		st = append(st, http2.Setting{ID: http2.SettingEnablePush, Val: 0},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: clientMaxHeaders})
	}
	if err := c.fr.WriteSettings(st...); err != nil {
		return err
	}
	if inc := c.cfg.ConnWindow - 65535; inc > 0 {
		return c.fr.WriteWindowUpdate(0, inc)
	}
	return nil
}

func (c *conn) lockWrite() {
	c.waiters.Add(1)
	c.wmu.Lock()
	c.waiters.Add(-1)
	c.activity.Add(1)
	if c.bc != nil {
		c.bc.held.Store(true)
	}
}

// unlockWrite flushes the coalesced records if nobody else is queued to write.
func (c *conn) unlockWrite() error {
	var err error
	if c.bc != nil && c.waiters.Load() == 0 {
		err = c.bc.Flush()
		if c.bc.capacity() > trimKeep && !c.writeGrown.Load() {
			c.noteWriteGrown()
		}
	}
	if c.bc != nil {
		c.bc.held.Store(false)
	}
	c.wmu.Unlock()
	return err
}

// queueLocked adds a control frame for writeLoop. c.mu held.
func (c *conn) queueLocked(op ctrlOp) {
	if c.closed {
		return
	}
	if len(c.ops) >= maxQueuedControl {
		c.flooded.Store(true) // the frame reader ends the connection
		return
	}
	c.ops = append(c.ops, op)
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// writeLoop owns the control-frame queue, the PING keepalive and (client) the idle timer.
func (c *conn) writeLoop() {
	defer c.wg.Done()
	tick := c.cfg.PingInterval
	if !c.server {
		tick = min(tick, c.cfg.IdleTimeout)
	}
	t := time.NewTimer(tick)
	defer t.Stop()
	trim := time.NewTimer(trimTick) // armed while a buffer is grown (trim.go)
	defer trim.Stop()
	trim.Stop()
	var trimC <-chan time.Time
	var seen uint64
	for {
		select {
		case <-c.kick:
		case <-t.C:
			c.onTick()
			t.Reset(tick)
		case <-trimC:
			if c.trimIfIdle(&seen) {
				trimC = nil
			} else {
				trim.Reset(trimTick)
			}
			continue // nothing to flush, and flushing would count as activity
		case <-c.done:
			return
		}
		if trimC == nil && c.grown() {
			seen = c.activity.Load()
			trim.Reset(trimTick)
			trimC = trim.C
		}
		if err := c.flushOps(); err != nil {
			c.closeWith(err)
			return
		}
	}
}

func (c *conn) onTick() {
	c.mu.Lock()
	now := time.Now()
	if c.pingOut && now.Sub(c.pingSent) >= c.cfg.PingTimeout {
		c.mu.Unlock()
		slog.Debug("hbone: dropping connection, no PING ack", "remote", c.nc.RemoteAddr(), "timeout", c.cfg.PingTimeout)
		c.closeWith(fmt.Errorf("%w (%v)", errPingTimeout, c.cfg.PingTimeout))
		return
	}
	if !c.pingOut {
		c.pingOut = true
		c.pingSent = now
		op := ctrlOp{kind: opPing}
		copy(op.data[:], "gozt-ka")
		c.queueLocked(op)
	}
	if !c.server && c.active == 0 && c.reserved == 0 && now.Sub(c.idleSince) >= c.cfg.IdleTimeout {
		c.goaway = true
		c.draining = true
		c.queueLocked(ctrlOp{kind: opGoAwayEnd})
	}
	c.mu.Unlock()
}

func (c *conn) flushOps() error {
	c.lockWrite()
	closeAfter, err := c.writeOpsWLocked()
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err == nil && closeAfter {
		c.closeWith(nil)
	}
	return err
}

// writeOpsWLocked writes the queued control frames (wmu held) and reports whether the
// connection is to close after them (a final GOAWAY).
func (c *conn) writeOpsWLocked() (closeAfter bool, err error) {
	c.mu.Lock()
	ops := c.ops
	c.ops = c.opsSpare[:0]
	c.mu.Unlock()
	for i := range ops {
		op := &ops[i]
		switch op.kind {
		case opSettingsAck:
			err = c.fr.WriteSettingsAck()
		case opPing:
			err = c.fr.WritePing(false, op.data)
		case opPingAck:
			err = c.fr.WritePing(true, op.data)
		case opWindowUpdate:
			err = c.fr.WriteWindowUpdate(op.id, op.val)
		case opRST:
			if op.s != nil {
				op.s.rstWritten = true
			}
			err = c.fr.WriteRSTStream(op.id, http2.ErrCode(op.val))
		case opStatus:
			err = c.writeHeadersWLocked(op.id, true, int(op.val), "", nil)
		case opGoAway:
			err = c.writeGoAwayWLocked(http2.ErrCode(op.val))
		case opGoAwayEnd:
			err = c.writeGoAwayWLocked(http2.ErrCodeNo)
			closeAfter = true
		}
		op.s = nil
		if err != nil {
			break
		}
	}
	c.mu.Lock()
	c.opsSpare = ops[:0]
	c.mu.Unlock()
	return closeAfter, err
}

// writeDataWLocked writes one DATA frame without END_STREAM (wmu held). Over a coalescing
// TLS conn the 9-byte header goes out as its own tiny TLS record, which shares the batch's
// write(2), so the payload is encrypted straight from p instead of being copied into the
// Framer's buffer first.
//
// A small payload is instead copied behind its header into one record: the copy is
// cheaper than a second record's seal on this side and its open on the peer's.
//
// In kernel TLS a large payload goes out in one writev(2) with the buffered frames and
// its header: the kernel cuts the records, so nothing is copied in user space.
func (c *conn) writeDataWLocked(id uint32, p []byte) error {
	if c.kt.conn != nil {
		return c.writeKernelDataWLocked(id, p)
	}
	if c.bc == nil || len(p) <= smallData {
		if len(p) > trimKeep && !c.bigWrites {
			c.bigWrites = true
			c.noteWriteGrown()
		}
		c.writing(frameHeaderLen + len(p))
		return c.fr.WriteData(id, false, p)
	}
	h := c.dataHeaderWLocked(id, len(p))
	if _, err := c.nc.Write(h); err != nil {
		return err
	}
	c.writing(len(p))
	_, err := c.nc.Write(p)
	return err
}

// dataHeaderWLocked fills the DATA frame header (no flags) for n payload bytes.
func (c *conn) dataHeaderWLocked(id uint32, n int) []byte {
	h := &c.dataHdr
	h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
	h[3], h[4] = byte(http2.FrameData), 0
	h[5], h[6], h[7], h[8] = byte(id>>24)&0x7f, byte(id>>16), byte(id>>8), byte(id)
	return h[:]
}

// smallData is the largest DATA payload written as one TLS record with its header
// (a record carries at most 16 KiB).
const smallData = 16<<10 - frameHeaderLen

// frameHeaderLen is an HTTP/2 frame header's length.
const frameHeaderLen = 9

func (c *conn) writeGoAwayWLocked(code http2.ErrCode) error {
	if c.goawaySent && code == http2.ErrCodeNo {
		return nil
	}
	c.goawaySent = true
	c.mu.Lock()
	last := c.lastPeerID
	c.mu.Unlock()
	return c.fr.WriteGoAway(last, code, nil)
}

// writeHeadersWLocked encodes and writes a header block (wmu held). For a response, status
// is non-zero; for a request, authority is set.
func (c *conn) writeHeadersWLocked(id uint32, end bool, status int, authority string, h http.Header) error {
	c.mu.Lock()
	maxFrame, tbl := c.peerMaxFrame, c.peerHdrTable
	c.mu.Unlock()
	if tbl != c.hencLimit {
		c.henc.SetMaxDynamicTableSizeLimit(tbl)
		c.hencLimit = tbl
	}
	c.hbuf.Reset()
	if status != 0 {
		c.henc.WriteField(hpack.HeaderField{Name: ":status", Value: strconv.Itoa(status)})
	} else {
		c.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		c.henc.WriteField(hpack.HeaderField{Name: ":authority", Value: authority})
	}
	for k, vs := range h {
		name := strings.ToLower(k)
		if hopByHop(name) || strings.HasPrefix(name, ":") {
			continue
		}
		for _, v := range vs {
			c.henc.WriteField(hpack.HeaderField{Name: name, Value: v, Sensitive: neverIndexed(name)})
		}
	}
	block := c.hbuf.Bytes()
	first := true
	for first || len(block) > 0 {
		n := min(len(block), int(maxFrame))
		var err error
		c.writing(frameHeaderLen + n)
		if first {
			err = c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:n], EndStream: end, EndHeaders: n == len(block)})
		} else {
			err = c.fr.WriteContinuation(id, n == len(block), block[:n])
		}
		if err != nil {
			return err
		}
		first = false
		block = block[n:]
	}
	return nil
}

// neverIndexed reports the request headers whose values are new on every stream (the
// Forwarded header names the client's port; a traceparent is random). Indexing them
// saves no byte, since no later stream repeats them, but fills both ends' HPACK dynamic
// tables with them: the encoder's maps of evicted entries grow to their peak and stay, and
// the peer's decoder holds each value until 4 KiB of others push it out, kept per HBONE
// connection (about 11 KiB of the client's and 3 KiB of the server's heap per pooled
// connection, 2026-12-05). They go out as literals never indexed, as a name the table
// already has.
func neverIndexed(name string) bool {
	return name == "traceparent" || name == "forwarded"
}

func hopByHop(name string) bool {
	switch name {
	case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "host":
		return true
	}
	return false
}
