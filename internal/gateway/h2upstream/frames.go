package h2upstream

import (
	"fmt"
	"net/http"
	"strconv"

	"golang.org/x/net/http2"
)

// process handles one frame read by the connection's goroutine.
func (c *conn) process(f http2.Frame) error {
	c.mu.Lock()
	c.frames++
	c.mu.Unlock()
	switch f := f.(type) {
	case *http2.DataFrame:
		return c.onData(f)
	case *http2.MetaHeadersFrame:
		return c.onHeaders(f)
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		c.mu.Lock()
		defer c.unlock()
		return c.onSettings(f)
	case *http2.WindowUpdateFrame:
		c.mu.Lock()
		defer c.unlock()
		return c.onWindowUpdate(f)
	case *http2.RSTStreamFrame:
		c.mu.Lock()
		if s := c.streams[f.StreamID]; s != nil {
			s.rstSent = true // never an RST_STREAM for an RST_STREAM
			s.endLocked(StreamResetError{Code: f.ErrCode, Remote: true}, nil)
		}
		c.unlock()
	case *http2.PingFrame:
		c.mu.Lock()
		defer c.mu.Unlock()
		if f.IsAck() {
			c.onPingAck()
			return nil
		}
		return c.writeLocked(func(w *writer) error { return w.fr.WritePing(true, f.Data) })
	case *http2.GoAwayFrame:
		c.onGoAway(f)
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	return nil
}

func (c *conn) onSettings(f *http2.SettingsFrame) error {
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingMaxConcurrentStreams:
			c.maxStreams = s.Val
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.peerWindow
			c.peerWindow = int64(s.Val)
			for _, st := range c.streams {
				st.sendWindow += delta
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = s.Val
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := c.writeLocked(func(w *writer) error { return w.fr.WriteSettingsAck() }); err != nil {
		return err
	}
	c.flushAllLocked()
	return nil
}

func (c *conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	if f.StreamID == 0 {
		if c.sendWindow+inc > 1<<31-1 {
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		c.sendWindow += inc
		c.flushAllLocked()
		return nil
	}
	s := c.streams[f.StreamID]
	if s == nil {
		return nil
	}
	if s.sendWindow+inc > 1<<31-1 {
		c.resetLocked(s, http2.ErrCodeFlowControl, nil)
		return nil
	}
	s.sendWindow += inc
	s.flushLocked()
	return nil
}

// flushAllLocked writes what the windows now allow of every stream's
// queued data.
func (c *conn) flushAllLocked() {
	for _, s := range c.streams {
		if s.queuedLocked() > 0 || s.outEnd {
			s.flushLocked()
		}
	}
}

// onGoAway stops new streams on c and fails those the server did not
// take; the connection closes when its last stream ends.
func (c *conn) onGoAway(f *http2.GoAwayFrame) {
	c.mu.Lock()
	defer c.unlock()
	c.goingAway = true
	err := GoAwayError{Code: f.ErrCode, LastStreamID: f.LastStreamID}
	for id, s := range c.streams {
		if id > f.LastStreamID {
			s.rstSent = true // the server forgot it
			s.endLocked(err, nil)
		}
	}
	if len(c.streams) == 0 {
		c.err = err
		c.closeLocked()
	}
}

// onData checks the frame against the windows, returns the connection's
// window at once, and hands the stream's messages to its handler.
func (c *conn) onData(f *http2.DataFrame) error {
	n := int64(f.Length)
	c.mu.Lock()
	c.recvUnacked += n
	if c.recvUnacked >= connWindow/2 {
		inc := c.recvUnacked
		c.recvUnacked = 0
		_ = c.writeLocked(func(w *writer) error { return w.fr.WriteWindowUpdate(0, uint32(inc)) })
	}
	s := c.streams[f.StreamID]
	if s == nil || s.remoteDone {
		c.unlock()
		if f.StreamID%2 == 0 || f.StreamID >= c.nextIDSnapshot() {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		return nil // a stream that ended: its bytes are dropped
	}
	if !s.gotHeaders {
		c.resetLocked(s, http2.ErrCodeProtocol, fmt.Errorf("h2upstream: DATA before HEADERS"))
		c.unlock()
		return nil
	}
	if n > s.recvWindow {
		c.resetLocked(s, http2.ErrCodeFlowControl, fmt.Errorf("h2upstream: server overran the stream's window"))
		c.unlock()
		return nil
	}
	s.recvWindow -= n
	padding := n - int64(len(f.Data()))
	c.unlock()
	held, err := s.msgs.Feed(f.Data(), func(flags byte, msg []byte, window int) error {
		if s.done.Load() { // reset meanwhile from another goroutine
			return ErrStreamEnded
		}
		if flags != 0 { // no grpc-accept-encoding was sent: none may come
			return ErrCompressed
		}
		s.h.OnMessage(s, msg, window)
		return nil
	})
	c.mu.Lock()
	defer c.unlock()
	if err != nil {
		c.resetLocked(s, http2.ErrCodeCancel, err)
		return nil
	}
	s.consumeLocked(int64(held) + padding)
	if f.StreamEnded() {
		// A gRPC answer ends with trailers, not DATA.
		s.remoteDone = true
		s.endLocked(nil, &Status{Code: CodeInternal, Message: "h2upstream: stream ended without trailers"})
	}
	return nil
}

func (c *conn) nextIDSnapshot() uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nextID
}

// onHeaders takes a response's headers, or its trailers.
func (c *conn) onHeaders(f *http2.MetaHeadersFrame) error {
	c.mu.Lock()
	defer c.unlock()
	s := c.streams[f.StreamID]
	if s == nil || s.remoteDone {
		if f.StreamID >= c.nextID || f.StreamID%2 == 0 {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		return nil
	}
	h := make(http.Header, len(f.RegularFields()))
	for _, hf := range f.RegularFields() {
		h.Add(http.CanonicalHeaderKey(hf.Name), hf.Value)
	}
	if s.gotHeaders {
		if !f.StreamEnded() {
			c.resetLocked(s, http2.ErrCodeProtocol, fmt.Errorf("h2upstream: trailers without END_STREAM"))
			return nil
		}
		s.remoteDone = true
		st := statusOf(h)
		if s.msgs.Partial() {
			st = Status{Code: CodeInternal, Message: "h2upstream: stream ended inside a message", Trailer: h}
		}
		s.endLocked(nil, &st)
		return nil
	}
	s.gotHeaders = true
	code, err := strconv.Atoi(f.PseudoValue("status"))
	switch {
	case err != nil || code < 200:
		c.resetLocked(s, http2.ErrCodeProtocol, fmt.Errorf("h2upstream: bad :status %q", f.PseudoValue("status")))
	case code != http.StatusOK:
		st := httpStatus(code)
		if f.StreamEnded() {
			s.remoteDone = true
			s.endLocked(nil, &st)
		} else {
			s.endLocked(nil, &st) // and RST_STREAM: its body is not wanted
		}
	case f.StreamEnded(): // trailers-only
		s.remoteDone = true
		st := statusOf(h)
		s.endLocked(nil, &st)
	default:
		hh := s.h
		c.pending = append(c.pending, func() { hh.OnHeaders(s, h) })
	}
	return nil
}
