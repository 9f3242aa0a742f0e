package wiretest

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// LogBuffer is a destination for a JSON log handler that a server's
// goroutines write to while the test reads it.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// Lines returns the logged lines whose message is msg and whose attributes
// include every key and value of with, decoded.
func (b *LogBuffer) Lines(t testing.TB, msg string, with map[string]any) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, s := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		if s == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			t.Fatalf("log line %q: %v", s, err)
		}
		if m["msg"] != msg {
			continue
		}
		match := true
		for k, v := range with {
			match = match && m[k] == v
		}
		if match {
			out = append(out, m)
		}
	}
	return out
}

// BadHandshake opens a connection to a TLS listener at addr, sends bytes
// that are not TLS and reads until the server hangs up, which net/http
// does after it logged the failed handshake. It returns the connection's
// local address: the peer the server saw.
func BadHandshake(t testing.TB, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("hello, this is not TLS\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, c)
	return c.LocalAddr().String()
}
