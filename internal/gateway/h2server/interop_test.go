package h2server

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// echoHTTP answers /echo with the request body, a header and trailers
// (one declared, one by TrailerPrefix); /lines echoes each line as it
// arrives (a bidirectional stream); /big sends ?n bytes.
func echoHTTP() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		w.Header().Set("Trailer", "X-Sum")
		w.Header().Set("X-Method", r.Method)
		w.WriteHeader(http.StatusOK)
		if _, err := io.Copy(io.MultiWriter(w, h), r.Body); err != nil {
			return
		}
		w.Header().Set("X-Sum", fmt.Sprintf("%x", h.Sum(nil)))
		w.Header().Set(http.TrailerPrefix+"X-Late", "yes")
	})
	mux.HandleFunc("/lines", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		sc := bufio.NewScanner(r.Body)
		for sc.Scan() {
			fmt.Fprintf(w, "echo %s\n", sc.Text())
			w.(http.Flusher).Flush()
		}
	})
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		var n int
		fmt.Sscan(r.URL.Query().Get("n"), &n)
		chunk := bytes.Repeat([]byte("0123456789abcdef"), 1024)
		for n > 0 {
			k := min(n, len(chunk))
			if _, err := w.Write(chunk[:k]); err != nil {
				return
			}
			n -= k
		}
	})
	return mux
}

type namedClient struct {
	name string
	c    *http.Client
}

func clients(t *testing.T) (string, []namedClient) {
	_, addr, pool := startTLS(t, Config{Handler: HTTP(echoHTTP())})
	return "https://" + addr, []namedClient{{"x/net/http2", x2Client(pool)}, {"net/http", stdClient(pool)}}
}

func TestUnaryAndTrailers(t *testing.T) {
	base, cs := clients(t)
	for _, c := range cs {
		t.Run(c.name, func(t *testing.T) {
			for _, size := range []int{0, 5, 1 << 20} { // 1 MiB: flow control both ways
				body := bytes.Repeat([]byte{'x'}, size)
				res, err := c.c.Post(base+"/echo", "text/plain", bytes.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(res.Body)
				res.Body.Close()
				if err != nil {
					t.Fatal(err)
				}
				if res.ProtoMajor != 2 || res.StatusCode != 200 || res.Header.Get("X-Method") != "POST" {
					t.Fatalf("proto %d status %d header %v", res.ProtoMajor, res.StatusCode, res.Header)
				}
				if !bytes.Equal(got, body) {
					t.Fatalf("size %d: echoed %d bytes", size, len(got))
				}
				if want := fmt.Sprintf("%x", sha256.Sum256(body)); res.Trailer.Get("X-Sum") != want || res.Trailer.Get("X-Late") != "yes" {
					t.Fatalf("trailers %v, want X-Sum %s and X-Late", res.Trailer, want)
				}
			}
		})
	}
}

func TestLargeResponse(t *testing.T) {
	base, cs := clients(t)
	for _, c := range cs {
		t.Run(c.name, func(t *testing.T) {
			const n = 3<<20 + 17
			res, err := c.c.Get(fmt.Sprintf("%s/big?n=%d", base, n))
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if err != nil || got != n {
				t.Fatalf("read %d bytes, err %v; want %d", got, err, n)
			}
		})
	}
}

func TestBidirectionalStream(t *testing.T) {
	base, cs := clients(t)
	for _, c := range cs {
		t.Run(c.name, func(t *testing.T) {
			pr, pw := io.Pipe()
			req, _ := http.NewRequest("POST", base+"/lines", pr)
			res, err := c.c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			rd := bufio.NewReader(res.Body)
			// Each line's answer is read before the next is sent: the
			// stream is full duplex.
			for i := range 5 {
				fmt.Fprintf(pw, "line %d\n", i)
				got, err := rd.ReadString('\n')
				if want := fmt.Sprintf("echo line %d\n", i); err != nil || got != want {
					t.Fatalf("got %q, %v; want %q", got, err, want)
				}
			}
			pw.Close()
			if rest, err := io.ReadAll(rd); err != nil || len(rest) != 0 {
				t.Fatalf("after the end: %q, %v", rest, err)
			}
		})
	}
}

func TestConcurrentStreams(t *testing.T) {
	base, cs := clients(t)
	for _, c := range cs {
		t.Run(c.name, func(t *testing.T) {
			var wg sync.WaitGroup
			errs := make(chan error, 40)
			for i := range 40 {
				wg.Go(func() {
					body := strings.Repeat(fmt.Sprint(i), 10000+i)
					res, err := c.c.Post(base+"/echo", "text/plain", strings.NewReader(body))
					if err != nil {
						errs <- err
						return
					}
					got, err := io.ReadAll(res.Body)
					res.Body.Close()
					if err != nil || string(got) != body {
						errs <- fmt.Errorf("stream %d: %d bytes, %v", i, len(got), err)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

// TestOtherProtocols: a TLS client that negotiates HTTP/1.1 goes to
// Config.Other when it is set, and is closed otherwise.
func TestOtherProtocols(t *testing.T) {
	cert, pool := testCert(t)
	tlsCfg := &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
	h1 := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}} // HTTP/1.1 only
	for _, withOther := range []bool{true, false} {
		t.Run(map[bool]string{true: "handed over", false: "closed"}[withOther], func(t *testing.T) {
			var wg sync.WaitGroup
			defer wg.Wait()
			cfg := Config{Handler: HTTP(echoHTTP()), TLS: tlsCfg}
			if withOther {
				cfg.Other = func(tc *tls.Conn) {
					wg.Go(func() {
						defer tc.Close()
						req, err := http.ReadRequest(bufio.NewReader(tc))
						if err != nil {
							return
						}
						_, _ = io.WriteString(tc, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"+req.URL.Path[1:3])
					})
				}
			}
			_, addr := start(t, cfg)
			res, err := h1.Get("https://" + addr + "/h1")
			if !withOther {
				if err == nil {
					res.Body.Close()
					t.Fatal("an HTTP/1.1 client was answered without Other")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.ProtoMajor != 1 || string(body) != "h1" {
				t.Fatalf("proto %d body %q", res.ProtoMajor, body)
			}
		})
	}
}
