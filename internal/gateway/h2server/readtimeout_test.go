package h2server

import (
	"errors"
	"io"
	"net/http"
	"os"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// TestReadTimeout: under HTTP, a request whose body has not ended within
// ReadTimeout is reset and its handler's read fails, as net/http's
// ReadTimeout does; a handler that lifts the deadline
// (http.ResponseController) keeps its stream.
func TestReadTimeout(t *testing.T) {
	for _, lift := range []bool{false, true} {
		name := map[bool]string{false: "body never sent", true: "deadline lifted"}[lift]
		t.Run(name, func(t *testing.T) {
			fake := clock.NewFake(t0)
			reading := make(chan struct{})
			readErr := make(chan error, 1)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if lift {
					if err := http.NewResponseController(w).SetReadDeadline(time.Time{}); err != nil {
						t.Errorf("SetReadDeadline: %v", err)
					}
				}
				close(reading)
				b, err := io.ReadAll(r.Body)
				readErr <- err
				if err == nil {
					_, _ = w.Write(b)
				}
			})
			_, addr := start(t, Config{Handler: HTTP(h), Clock: fake, ReadTimeout: 30 * time.Second, PingInterval: time.Hour})
			c := dialRaw(t, addr)
			c.until("SETTINGS ACK", isSettingsAck)
			if err := c.open(1, false); err != nil {
				t.Fatal(err)
			}
			<-reading
			want := 2 // the keepalive and the body's deadline
			if lift {
				want = 1
			}
			waitArmed(t, fake, want)
			fake.Advance(30 * time.Second)
			if !lift {
				rst := c.until("RST_STREAM", isRST(1)).(*http2.RSTStreamFrame)
				if rst.ErrCode != http2.ErrCodeCancel {
					t.Fatalf("RST_STREAM %v, want CANCEL", rst.ErrCode)
				}
				if err := <-readErr; !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("the handler's read: %v, want a deadline exceeded", err)
				}
				return
			}
			if err := c.do(func(fr *http2.Framer) error { return fr.WriteData(1, true, []byte("late body")) }); err != nil {
				t.Fatal(err)
			}
			if err := <-readErr; err != nil {
				t.Fatalf("the handler's read: %v", err)
			}
			d := c.until("the echo", func(f http2.Frame) bool {
				d, ok := f.(*http2.DataFrame)
				return ok && d.StreamID == 1 && len(d.Data()) > 0
			}).(*http2.DataFrame)
			if string(d.Data()) != "late body" {
				t.Fatalf("echo %q", d.Data())
			}
		})
	}
}
