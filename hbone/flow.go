package hbone

// Flow control: windows returned as data is consumed, and the peer's SETTINGS and
// WINDOW_UPDATEs.

import (
	"errors"

	"golang.org/x/net/http2"
)

// releaseConnLocked returns n bytes of connection window to the peer, batched.
func (c *conn) releaseConnLocked(n int64) {
	c.connUnacked += n
	if c.connUnacked >= int64(c.cfg.ConnWindow/4) {
		c.queueLocked(ctrlOp{kind: opWindowUpdate, val: uint32(c.connUnacked)})
		c.recvConnAvail += c.connUnacked
		c.connUnacked = 0
	}
}

// consumedLocked returns window for n bytes handed to the stream's consumer, batched.
func (c *conn) consumedLocked(s *Stream, n int) {
	c.releaseConnLocked(int64(n))
	s.unacked += int64(n)
	if s.unacked >= int64(c.cfg.StreamWindow/4) && !s.recvEnd && !s.done {
		c.queueLocked(ctrlOp{kind: opWindowUpdate, id: s.id, val: uint32(s.unacked)})
		s.recvAvail += s.unacked
		s.unacked = 0
	}
}

func (c *conn) handleSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	err := f.ForeachSetting(func(st http2.Setting) error {
		if err := st.Valid(); err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return connError{http2.ErrCode(ce), "bad setting " + st.String()}
			}
			return connError{http2.ErrCodeProtocol, "bad setting " + st.String()}
		}
		switch st.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(st.Val) - c.peerInitWindow
			c.peerInitWindow = int64(st.Val)
			for _, s := range c.streams {
				s.sendAvail += delta
				if s.sendAvail > maxWindow {
					return connError{http2.ErrCodeFlowControl, "stream window overflow"}
				}
				s.cond.Broadcast()
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = st.Val
		case http2.SettingMaxConcurrentStreams:
			c.peerMaxStreams = st.Val
		case http2.SettingHeaderTableSize:
			c.peerHdrTable = min(st.Val, 4096)
		}
		return nil
	})
	if err != nil {
		return err
	}
	c.queueLocked(ctrlOp{kind: opSettingsAck})
	if !c.gotSettings {
		c.gotSettings = true
		close(c.settingsCh)
	}
	return c.junkLocked()
}

func (c *conn) handleWindowUpdate(f *http2.WindowUpdateFrame) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	inc := int64(f.Increment)
	if inc < minUsefulWindowUpdate {
		if err := c.junkLocked(); err != nil {
			return err
		}
	}
	if f.StreamID == 0 {
		c.sendConnAvail += inc
		if c.sendConnAvail > maxWindow {
			return connError{http2.ErrCodeFlowControl, "connection window overflow"}
		}
		c.wakeConnWaitersLocked()
		return nil
	}
	if c.idleLocked(f.StreamID) {
		return connError{http2.ErrCodeProtocol, "WINDOW_UPDATE on idle stream"}
	}
	s := c.streams[f.StreamID]
	if s == nil {
		return nil // closed stream: allowed (RFC 9113 §6.9)
	}
	s.sendAvail += inc
	if s.sendAvail > maxWindow {
		c.resetLocked(s, s.id, http2.ErrCodeFlowControl)
		return nil
	}
	s.cond.Broadcast()
	return nil
}

// wakeConnWaitersLocked wakes the streams waiting for connection window.
func (c *conn) wakeConnWaitersLocked() {
	if c.connWaiters == 0 {
		return
	}
	for _, s := range c.streams {
		if s.waitConn {
			s.cond.Broadcast()
		}
	}
}
