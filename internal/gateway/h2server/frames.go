package h2server

import (
	"net/textproto"
	"strconv"
	"strings"

	"golang.org/x/net/http2"
)

// process handles one frame read by the connection's goroutine.
func (c *conn) process(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.MetaHeadersFrame:
		return c.onHeaders(f)
	case *http2.DataFrame:
		return c.onData(f)
	case *http2.WindowUpdateFrame:
		return c.onWindowUpdate(f)
	case *http2.SettingsFrame:
		if err := c.spend(); err != nil {
			return err
		}
		return c.onSettings(f)
	case *http2.PingFrame:
		if err := c.spend(); err != nil {
			return err
		}
		if f.IsAck() {
			c.onPingAck(f.Data)
			return nil
		}
		return c.write(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
	case *http2.RSTStreamFrame:
		if err := c.spend(); err != nil {
			return err
		}
		return c.onReset(f)
	case *http2.PriorityFrame:
		if f.StreamDep == f.StreamID {
			c.resetStream(f.StreamID, http2.ErrCodeProtocol) // depends on itself
		}
		return c.spend()
	case *http2.GoAwayFrame:
		return nil // the client stops opening streams; those open finish
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(http2.ErrCodeProtocol)
	case *http2.ContinuationFrame:
		// ReadMetaHeaders takes every expected one.
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	return nil // unknown frame types are ignored
}

func (c *conn) onSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		return nil
	}
	var ferr error
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		switch s.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.peerWindow
			c.peerWindow = int64(s.Val)
			for _, st := range c.streams {
				st.sendWindow += delta
				if st.sendWindow > 1<<31-1 {
					ferr = http2.ConnectionError(http2.ErrCodeFlowControl)
				}
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = s.Val
		}
		return ferr
	})
	if err != nil {
		return err
	}
	c.mu.Lock()
	err = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
	c.flushAllLocked()
	c.unlock()
	return err
}

func (c *conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	c.mu.Lock()
	if f.StreamID == 0 {
		c.sendWindow += int64(f.Increment)
		if c.sendWindow > 1<<31-1 {
			c.mu.Unlock()
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		c.flushAllLocked()
		c.unlock()
		return nil
	}
	if f.StreamID > c.maxStreamID {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol) // an idle stream
	}
	s := c.streams[f.StreamID]
	if s == nil {
		c.mu.Unlock()
		return nil // closed: a late update
	}
	s.sendWindow += int64(f.Increment)
	if s.sendWindow > 1<<31-1 {
		c.resetLocked(s, http2.ErrCodeFlowControl)
		c.unlock()
		return nil
	}
	s.flushLocked()
	c.unlock()
	return nil
}

func (c *conn) onReset(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	if f.StreamID > c.maxStreamID {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if s := c.streams[f.StreamID]; s != nil {
		s.endLocked(StreamResetError{Code: f.ErrCode, Remote: true})
	}
	c.unlock()
	return nil
}

// resetStream answers a stream error: RST_STREAM, and the stream ends.
func (c *conn) resetStream(id uint32, code http2.ErrCode) {
	c.mu.Lock()
	if s := c.streams[id]; s != nil {
		c.resetLocked(s, code)
	} else {
		_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
	}
	if id > c.maxStreamID && id%2 == 1 {
		c.maxStreamID = id
	}
	c.unlock()
}

func (c *conn) resetLocked(s *Stream, code http2.ErrCode) {
	_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteRSTStream(s.id, code) })
	s.endLocked(StreamResetError{Code: code})
}

func (c *conn) onData(f *http2.DataFrame) error {
	id, n := f.StreamID, int64(f.Length)
	data := f.Data()
	end := f.StreamEnded()
	if len(data) == 0 && !end {
		if err := c.spend(); err != nil {
			return err
		}
	}
	c.mu.Lock()
	if n > c.recvWindow {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeFlowControl)
	}
	c.recvWindow -= n
	// The connection's window goes back at once: the streams' windows
	// bound what is buffered.
	c.grantConnLocked(n)
	if id > c.maxStreamID {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol) // an idle stream
	}
	s := c.streams[id]
	if s == nil || s.remoteDone {
		if s != nil {
			c.resetLocked(s, http2.ErrCodeStreamClosed)
		} else {
			_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeStreamClosed) })
		}
		c.unlock()
		return c.spend() // each reset the client causes counts
	}
	if n > s.recvWindow {
		c.resetLocked(s, http2.ErrCodeFlowControl)
		c.unlock()
		return nil
	}
	s.recvWindow -= n
	s.recvd += int64(len(data))
	if s.wantLen >= 0 && (s.recvd > s.wantLen || end && s.recvd != s.wantLen) {
		c.resetLocked(s, http2.ErrCodeProtocol)
		c.unlock()
		return nil
	}
	// Padding is consumed here.
	s.consumeLocked(n - int64(len(data)))
	if end {
		s.remoteDone = true
		s.maybeEndLocked()
	}
	h := s.h
	if h == nil {
		s.consumeLocked(int64(len(data)))
	}
	c.unlock()
	if h != nil {
		h.Data(s, data, end)
	}
	return nil
}

// grantConnLocked returns n bytes of connection window, in batches.
func (c *conn) grantConnLocked(n int64) {
	c.recvUnacked += n
	if c.recvUnacked < connWindow/2 {
		return
	}
	inc := c.recvUnacked
	c.recvUnacked = 0
	c.recvWindow += inc
	_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, uint32(inc)) })
}

// connection-specific fields a request must not carry (RFC 9113 8.2.2).
var connectionFields = map[string]bool{"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true, "upgrade": true}

func (c *conn) onHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	if id%2 == 0 {
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if f.HasPriority() && f.Priority.StreamDep == id {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol} // depends on itself
	}
	c.mu.Lock()
	if s := c.streams[id]; s != nil {
		// Trailers: they must end the stream and carry no pseudo fields.
		if s.remoteDone {
			c.resetLocked(s, http2.ErrCodeStreamClosed)
		} else if !f.StreamEnded() || len(f.PseudoFields()) > 0 || s.wantLen >= 0 && s.recvd != s.wantLen {
			c.resetLocked(s, http2.ErrCodeProtocol)
		} else {
			s.remoteDone = true
			s.maybeEndLocked()
			h := s.h
			c.unlock()
			if h != nil {
				h.Data(s, nil, true)
			}
			return nil
		}
		c.unlock()
		return nil
	}
	if id <= c.maxStreamID {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol) // a closed stream
	}
	c.maxStreamID = id
	if c.goingAway {
		c.mu.Unlock()
		return nil // after our GOAWAY: ignored, the client retries elsewhere
	}
	if uint32(len(c.streams)) >= c.cfg.MaxConcurrentStreams {
		_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) })
		c.mu.Unlock()
		return c.spend()
	}
	req, code := c.request(f)
	if code == http2.ErrCodeNo && f.StreamEnded() && req.ContentLength > 0 {
		code = http2.ErrCodeProtocol
	}
	if code != http2.ErrCodeNo {
		_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
		c.mu.Unlock()
		return c.spend() // each reset the client causes counts
	}
	s := c.newStreamLocked(id, req, f.StreamEnded())
	if f.Truncated {
		// 431, as net/http answers a header list over the limit.
		s.writeHeadersLocked(431, nil, true)
		if !s.remoteDone {
			c.resetLocked(s, http2.ErrCodeNo)
		}
		c.unlock()
		return nil
	}
	c.mu.Unlock()
	h := c.cfg.Handler.ServeStream(s)
	c.mu.Lock()
	s.h = h
	if h == nil {
		s.consumeLocked(s.recvd)
	}
	c.noteLocked(s)
	c.unlock()
	if h != nil && f.StreamEnded() {
		h.Data(s, nil, true) // a request without a body
	}
	return nil
}

// request checks a request's header block and builds its Request, or
// names the stream error.
func (c *conn) request(f *http2.MetaHeadersFrame) (*Request, http2.ErrCode) {
	r := &Request{
		Method:    f.PseudoValue("method"),
		Path:      f.PseudoValue("path"),
		Scheme:    f.PseudoValue("scheme"),
		Authority: f.PseudoValue("authority"),
		Header:    make(map[string][]string, len(f.RegularFields())),
		TLS:       c.state,
	}
	if f.PseudoValue("status") != "" || f.PseudoValue("protocol") != "" {
		return nil, http2.ErrCodeProtocol
	}
	if r.Method == "" || r.Method != "CONNECT" && (r.Path == "" || r.Scheme == "") {
		return nil, http2.ErrCodeProtocol
	}
	if r.Method == "CONNECT" {
		return nil, http2.ErrCodeRefusedStream // not served
	}
	var cookies []string
	for _, hf := range f.RegularFields() {
		switch {
		case connectionFields[hf.Name]:
			return nil, http2.ErrCodeProtocol
		case hf.Name == "te" && hf.Value != "trailers":
			return nil, http2.ErrCodeProtocol
		case hf.Name == "cookie":
			cookies = append(cookies, hf.Value)
			continue
		}
		k := textproto.CanonicalMIMEHeaderKey(hf.Name)
		r.Header[k] = append(r.Header[k], hf.Value)
	}
	if len(cookies) > 0 {
		r.Header["Cookie"] = []string{strings.Join(cookies, "; ")}
	}
	r.ContentLength = -1
	if cl := r.Header["Content-Length"]; len(cl) > 0 {
		n, err := strconv.ParseInt(cl[0], 10, 64)
		if err != nil || n < 0 || len(cl) > 1 {
			return nil, http2.ErrCodeProtocol
		}
		r.ContentLength = n
	}
	return r, http2.ErrCodeNo
}
