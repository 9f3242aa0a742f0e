package export

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/certfile"
)

// SinkConfig is one [[export.sinks]] table.
type SinkConfig struct {
	// Kind is "webhook", "file" or "stdout".
	Kind string `toml:"kind"`
	// Name keys the sink's position in the database (default: the kind and
	// its url or path). Renaming a sink starts it from the beginning.
	Name string `toml:"name"`
	// Kinds are what the sink takes: "events", "audit" (default both).
	Kinds []string `toml:"kinds"`

	// URL is where a webhook POSTs batches: https, or http only with
	// AllowHTTPLoopback and a loopback host.
	URL string `toml:"url"`
	// AllowHTTPLoopback lets URL be http:// when its host is a loopback
	// address (127.0.0.0/8, ::1, localhost): a collector on this host.
	// SECURITY: batches and the secret cross the network only over TLS;
	// an http URL to any other host is a config error even with this set.
	AllowHTTPLoopback bool `toml:"allow_http_loopback"`
	// Format of a webhook batch: "ndjson" (one item a line, the default)
	// or "array" (one JSON array).
	Format string `toml:"format"`
	// CAFile holds the CAs a webhook's server certificate must chain to
	// (default: the system's); reloaded when it changes.
	CAFile string `toml:"ca_file"`
	// SecretFile holds a secret, read at each batch; Auth says how it is
	// sent: "bearer" (Authorization: Bearer <secret>, the default) or
	// "hmac" (X-Better-Compute-Signature: sha256=<hex HMAC of the body>).
	SecretFile string `toml:"secret_file"`
	Auth       string `toml:"auth"`
	// Timeout bounds one delivery attempt (default 10s).
	Timeout time.Duration `toml:"timeout"`

	// Path is the file a file sink appends JSON lines to.
	Path string `toml:"path"`
}

// newSink checks c and builds its sink.
func newSink(c SinkConfig, log *slog.Logger) (*sink, error) {
	s := &sink{name: c.Name}
	if len(c.Kinds) == 0 {
		c.Kinds = []string{"events", "audit"}
	}
	for _, k := range c.Kinds {
		switch k {
		case "events":
			s.events = true
		case "audit":
			s.audit = true
		default:
			return nil, fmt.Errorf("kinds: %q is neither \"events\" nor \"audit\"", k)
		}
	}
	var err error
	switch c.Kind {
	case "webhook":
		s.deliver, err = newWebhook(c, log)
		if s.name == "" {
			s.name = "webhook:" + c.URL
		}
	case "file":
		if c.Path == "" {
			return nil, errors.New("a file sink needs a path")
		}
		s.deliver = (&fileSink{path: c.Path}).deliver
		if s.name == "" {
			s.name = "file:" + filepath.Clean(c.Path)
		}
	case "stdout":
		s.deliver = (&fileSink{out: os.Stdout}).deliver
		if s.name == "" {
			s.name = "stdout"
		}
	default:
		return nil, fmt.Errorf("kind %q: want \"webhook\", \"file\" or \"stdout\"", c.Kind)
	}
	return s, err
}

// webhook POSTs batches; a 2xx answer acknowledges one.
type webhook struct {
	url, format, secretFile, auth string
	client                        *http.Client
}

func newWebhook(c SinkConfig, log *slog.Logger) (func(context.Context, []Item) error, error) {
	if err := checkURL(c); err != nil {
		return nil, err
	}
	if c.Format == "" {
		c.Format = "ndjson"
	}
	if !slices.Contains([]string{"ndjson", "array"}, c.Format) {
		return nil, fmt.Errorf("format %q: want \"ndjson\" or \"array\"", c.Format)
	}
	if c.Auth == "" {
		c.Auth = "bearer"
	}
	if !slices.Contains([]string{"bearer", "hmac"}, c.Auth) {
		return nil, fmt.Errorf("auth %q: want \"bearer\" or \"hmac\"", c.Auth)
	}
	if c.SecretFile != "" {
		if _, err := readSecret(c.SecretFile); err != nil {
			return nil, err
		}
	}
	if c.Timeout <= 0 {
		c.Timeout = 10 * time.Second
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if c.CAFile != "" {
		pool, err := certfile.LoadPool(c.CAFile, log)
		if err != nil {
			return nil, fmt.Errorf("ca_file %s: %w", c.CAFile, err)
		}
		// Verified by hand so that a rotated CA file is taken without a
		// restart; the same checks as RootCAs (certfile.VerifyServer).
		tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: true,
			VerifyConnection: func(cs tls.ConnectionState) error { return certfile.VerifyServer(cs, pool.Get()) }}
	}
	// SECURITY: a redirect is never followed. Following one would send
	// the batch, and the bearer secret with it, to wherever the sink (or
	// whoever answers for it) points: another host, or http in the clear.
	// A 3xx is a failed delivery (deliver says so), retried like a 5xx.
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	w := &webhook{url: c.URL, format: c.Format, secretFile: c.SecretFile, auth: c.Auth,
		client: &http.Client{Transport: tr, Timeout: c.Timeout, CheckRedirect: noRedirect}}
	return w.deliver, nil
}

// checkURL refuses a webhook URL that is not https, unless the sink
// allows http to a loopback collector and the URL's host is one.
func checkURL(c SinkConfig) error {
	u, err := url.Parse(c.URL)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return fmt.Errorf("url %q: want an https URL", c.URL)
	}
	if u.User != nil {
		return fmt.Errorf("url %q: credentials in the URL are not sent; use secret_file", u.Redacted())
	}
	if u.Scheme == "https" {
		return nil
	}
	if !c.AllowHTTPLoopback {
		return fmt.Errorf("url %q: http would send batches and the secret in the clear; use https, or set allow_http_loopback for a collector on this host", c.URL)
	}
	if !isLoopback(u.Hostname()) {
		return fmt.Errorf("url %q: allow_http_loopback allows http only to a loopback host (127.0.0.1, ::1, localhost), not %q", c.URL, u.Hostname())
	}
	return nil
}

// isLoopback reports whether host is a loopback IP literal or localhost.
// A name other than localhost is refused even if it resolves to loopback
// today: resolution can change after the config is checked.
func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Unmap().IsLoopback()
}

func readSecret(file string) (string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("secret_file: %w", err)
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", fmt.Errorf("secret_file %s is empty", file)
	}
	return s, nil
}

func (w *webhook) deliver(ctx context.Context, items []Item) error {
	var body []byte
	var err error
	ctype := "application/x-ndjson"
	if w.format == "array" {
		body, err = json.Marshal(items)
		ctype = "application/json"
	} else {
		body, err = jsonLines(items)
	}
	if err != nil {
		return fmt.Errorf("encode batch: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", ctype)
	// The batch's key: the same batch resent has the same key. Items
	// carry their own id, the key a sink dedupes on.
	req.Header.Set("Idempotency-Key", batchKey(items))
	if w.secretFile != "" {
		// SECURITY: read at each batch, so a rotated secret is sent
		// without a restart; never logged.
		secret, err := readSecret(w.secretFile)
		if err != nil {
			return err
		}
		if w.auth == "hmac" {
			m := hmac.New(sha256.New, []byte(secret))
			m.Write(body)
			req.Header.Set("X-Better-Compute-Signature", "sha256="+hex.EncodeToString(m.Sum(nil)))
		} else {
			req.Header.Set("Authorization", "Bearer "+secret)
		}
	}
	resp, err := w.client.Do(req)
	if err != nil {
		return fmt.Errorf("post batch: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode >= 300 && resp.StatusCode <= 399 {
		// Only the Location's scheme and host are named: its path or query
		// could carry something a log should not.
		to := "no Location"
		if loc, err := resp.Location(); err == nil {
			to = loc.Scheme + "://" + loc.Host
		}
		return fmt.Errorf("post batch: %s answered %s (to %s): redirects are never followed, point the sink's url at where it redirects to: %w", w.url, resp.Status, to, errRedirect)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("post batch: %s answered %s", w.url, resp.Status)
	}
	return nil
}

// errRedirect marks a delivery refused because the sink redirected.
var errRedirect = errors.New("redirect refused")

// batchKey is a digest of the batch's ids.
func batchKey(items []Item) string {
	h := sha256.New()
	for _, it := range items {
		h.Write([]byte(it.ID))
		h.Write([]byte{'\n'})
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// fileSink appends JSON lines to a file (fsynced per batch) or stdout.
type fileSink struct {
	path string
	out  *os.File // stdout

	mu sync.Mutex
}

func (f *fileSink) deliver(_ context.Context, items []Item) error {
	b, err := jsonLines(items)
	if err != nil {
		return fmt.Errorf("encode batch: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.out != nil {
		_, err := f.out.Write(b)
		return err
	}
	file, err := os.OpenFile(f.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("open %s: %w", f.path, err)
	}
	if _, err := file.Write(b); err != nil {
		file.Close()
		return fmt.Errorf("append to %s: %w", f.path, err)
	}
	// The position is committed only after this: a crash before it
	// resends the batch (duplicate lines, same ids), never loses one.
	if err := file.Sync(); err != nil {
		file.Close()
		return fmt.Errorf("fsync %s: %w", f.path, err)
	}
	return file.Close()
}
