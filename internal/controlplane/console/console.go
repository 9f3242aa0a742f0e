// Package console is the control plane's web console, served by the API
// under {basePath}/console/: server-rendered pages (html/template) for join
// requests, join tokens, nodes and events, with one static stylesheet and
// one static script (no inline script or style: the CSP forbids them).
//
// The console holds no authority of its own. Every page calls the API's own
// Connect handler in-process (Config.API) with the signed-in API key as the
// bearer credential, so it passes through the same authentication,
// authorization and error mapping as the CLI; it never reads the store.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// CSP is the Content-Security-Policy of every console answer.
// connect-src 'self' lets console.js poll the console's own JSON (default-src
// 'none' would refuse it); nothing else may load from anywhere else.
const CSP = "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// SessionTTL is how long a sign-in lasts.
const SessionTTL = 8 * time.Hour

// cookieName holds the session id; preCookie the sign-in form's CSRF seed.
const (
	cookieName = "bc_console"
	preCookie  = "bc_console_pre"
)

// Config lists the console's dependencies.
type Config struct {
	// API is the API's own handler; the console calls it in-process.
	API http.Handler
	// BasePath is the API's base path (e.g. /api/compute); the console is
	// served under BasePath + "/console/".
	BasePath string
	Clock    clock.Clock
	Log      *slog.Logger

	// MaxSessions and MaxSessionsPerKey bound the sessions held, in
	// total and per API key (defaults DefaultMaxSessions,
	// DefaultMaxSessionsPerKey): a sign-in past a bound ends the oldest
	// session it counts against.
	MaxSessions, MaxSessionsPerKey int
	// SignInsPerMinute bounds the sign-in attempts of one source address
	// each minute (default DefaultSignInsPerMinute); more answer 429.
	SignInsPerMinute int
	// SweepEvery is how often Run drops expired sessions (default
	// DefaultSweepEvery).
	SweepEvery time.Duration
}

// Console serves the web console.
type Console struct {
	cfg    Config
	prefix string
	tmpl   *template.Template
	mux    *http.ServeMux
	// secret keys the sign-in form's CSRF tokens; random per process.
	secret []byte

	// signins limits sign-in attempts per source address.
	signins *ratelimit.Limiter

	mu       sync.Mutex
	sessions *sessions
}

// session is a signed-in browser: the key it signed in with (kept only in
// this process's memory) and its CSRF synchronizer token.
type session struct {
	id      string
	key     string
	csrf    string
	expires time.Time
	// notice and failure are the last action's outcome, shown once.
	notice, failure string
}

// New builds the console.
func New(cfg Config) (*Console, error) {
	if cfg.API == nil {
		return nil, errs.New(errs.InvalidConfig, "console: the API handler is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.MaxSessionsPerKey <= 0 {
		cfg.MaxSessionsPerKey = DefaultMaxSessionsPerKey
	}
	if cfg.SignInsPerMinute <= 0 {
		cfg.SignInsPerMinute = DefaultSignInsPerMinute
	}
	if cfg.SweepEvery <= 0 {
		cfg.SweepEvery = DefaultSweepEvery
	}
	tmpl, err := template.New("").Funcs(funcs).ParseFS(templateFS, "templates/*.html")
	if err != nil {
		return nil, errs.Wrap(err, errs.Internal, "console templates: %v", err)
	}
	c := &Console{cfg: cfg, prefix: "/" + strings.Trim(cfg.BasePath, "/") + "/console", tmpl: tmpl,
		mux: http.NewServeMux(), secret: randomBytes(32), sessions: newSessions(cfg.MaxSessions, cfg.MaxSessionsPerKey),
		signins: ratelimit.New(cfg.Clock, cfg.SignInsPerMinute, time.Minute)}
	if c.prefix == "//console" {
		c.prefix = "/console"
	}
	static, _ := fs.Sub(staticFS, "static")
	c.mux.Handle("GET "+c.prefix+"/static/", http.StripPrefix(c.prefix+"/static/", http.FileServerFS(static)))
	c.mux.HandleFunc("GET "+c.prefix+"/{$}", c.index)
	c.mux.HandleFunc("GET "+c.prefix+"/signin", c.signinPage)
	c.mux.HandleFunc("POST "+c.prefix+"/signin", c.signin)
	c.mux.HandleFunc("POST "+c.prefix+"/signout", c.post(c.signout))
	c.mux.HandleFunc("GET "+c.prefix+"/join-requests", c.get(c.joinRequests))
	c.mux.HandleFunc("POST "+c.prefix+"/join-requests", c.post(c.decide))
	c.mux.HandleFunc("GET "+c.prefix+"/tokens", c.get(c.tokens))
	c.mux.HandleFunc("POST "+c.prefix+"/tokens/create", c.post(c.createToken))
	c.mux.HandleFunc("POST "+c.prefix+"/tokens/revoke", c.post(c.revokeToken))
	c.mux.HandleFunc("GET "+c.prefix+"/tokens/joined.json", c.get(c.joinedJSON))
	c.mux.HandleFunc("GET "+c.prefix+"/nodes", c.get(c.nodes))
	c.mux.HandleFunc("GET "+c.prefix+"/events", c.get(c.events))
	c.mux.HandleFunc("GET "+c.prefix+"/events.json", c.get(c.eventsJSON))
	return c, nil
}

// Prefix is the path the console is served under (no trailing slash).
func (c *Console) Prefix() string { return c.prefix }

// ServeHTTP serves the console with its security headers on every answer.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", CSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cache-Control", "no-store")
	c.mux.ServeHTTP(w, r)
}

// get wraps a page that needs a session: without one it redirects to the
// sign-in page.
func (c *Console) get(fn func(w http.ResponseWriter, r *http.Request, s *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s := c.session(r)
		if s == nil {
			http.Redirect(w, r, c.prefix+"/signin", http.StatusSeeOther)
			return
		}
		fn(w, r, s)
	}
}

// post wraps a form action: it needs a session and the session's CSRF
// token in the form (synchronizer token); else 403.
func (c *Console) post(fn func(w http.ResponseWriter, r *http.Request, s *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s := c.session(r)
		if s == nil {
			http.Error(w, "not signed in\n", http.StatusForbidden)
			return
		}
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form\n", http.StatusBadRequest)
			return
		}
		if !equal(r.PostForm.Get("csrf"), s.csrf) {
			http.Error(w, "missing or wrong CSRF token\n", http.StatusForbidden)
			return
		}
		fn(w, r, s)
	}
}

func equal(a, b string) bool {
	return a != "" && subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

func (c *Console) session(r *http.Request) *session {
	ck, err := r.Cookie(cookieName)
	if err != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.sessions.get(ck.Value)
	if s == nil {
		return nil
	}
	if !c.cfg.Clock.Now().Before(s.expires) {
		c.sessions.remove(ck.Value)
		return nil
	}
	return s
}

func (c *Console) cookie(name, value string, maxAge int) *http.Cookie {
	return &http.Cookie{Name: name, Value: value, Path: c.prefix, MaxAge: maxAge,
		HttpOnly: true, Secure: true, SameSite: http.SameSiteStrictMode}
}

func (c *Console) index(w http.ResponseWriter, r *http.Request) {
	if c.session(r) == nil {
		http.Redirect(w, r, c.prefix+"/signin", http.StatusSeeOther)
		return
	}
	http.Redirect(w, r, c.prefix+"/join-requests", http.StatusSeeOther)
}

// preToken is the sign-in form's CSRF token: an HMAC of a random value the
// browser holds in a cookie (there is no session yet to tie it to).
func (c *Console) preToken(seed string) string {
	m := hmac.New(sha256.New, c.secret)
	m.Write([]byte("signin\x00" + seed))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (c *Console) signinPage(w http.ResponseWriter, r *http.Request) {
	c.renderSignin(w, r, "", http.StatusOK)
}

func (c *Console) renderSignin(w http.ResponseWriter, r *http.Request, msg string, status int) {
	seed := ""
	if ck, err := r.Cookie(preCookie); err == nil && ck.Value != "" {
		seed = ck.Value
	} else {
		seed = randomID()
		http.SetCookie(w, c.cookie(preCookie, seed, 3600))
	}
	c.render(w, status, "signin", map[string]any{"Prefix": c.prefix, "Name": "", "CSRF": c.preToken(seed), "Error": msg})
}

// signin checks the key through the API's own authentication (a call made
// with it) and starts a session.
func (c *Console) signin(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, "bad form\n", http.StatusBadRequest)
		return
	}
	ck, err := r.Cookie(preCookie)
	if err != nil || !equal(r.PostForm.Get("csrf"), c.preToken(ck.Value)) {
		http.Error(w, "missing or wrong CSRF token\n", http.StatusForbidden)
		return
	}
	// SECURITY: every attempt costs a key check and may start a session;
	// a source gets SignInsPerMinute of them, right or wrong.
	if ok, _ := c.signins.Allow(source(r.RemoteAddr)); !ok {
		w.Header().Set("Retry-After", "60")
		c.renderSignin(w, r, "too many sign-ins from this address: try again in a minute", http.StatusTooManyRequests)
		return
	}
	key := strings.TrimSpace(r.PostForm.Get("key"))
	if err := c.verify(r.Context(), key); err != nil {
		c.renderSignin(w, r, errText(err), http.StatusUnauthorized)
		return
	}
	id := randomID()
	now := c.cfg.Clock.Now()
	c.mu.Lock()
	c.sessions.sweep(now)
	c.sessions.add(&session{id: id, key: key, csrf: randomID(), expires: now.Add(SessionTTL)})
	c.mu.Unlock()
	http.SetCookie(w, c.cookie(cookieName, id, int(SessionTTL/time.Second)))
	http.SetCookie(w, c.cookie(preCookie, "", -1))
	http.Redirect(w, r, c.prefix+"/join-requests", http.StatusSeeOther)
}

// verify authenticates key as the API does: UNAUTHENTICATED refuses it; any
// other answer (a key without grants may be denied the list) admits it.
func (c *Console) verify(ctx context.Context, key string) error {
	if key == "" {
		return errs.New(errs.Unauthenticated, "an API key is required")
	}
	_, err := c.listTenants(ctx, key)
	if errs.Is(err, errs.Unauthenticated) {
		return err
	}
	return nil
}

func (c *Console) signout(w http.ResponseWriter, r *http.Request, _ *session) {
	if ck, err := r.Cookie(cookieName); err == nil {
		c.mu.Lock()
		c.sessions.remove(ck.Value)
		c.mu.Unlock()
	}
	http.SetCookie(w, c.cookie(cookieName, "", -1))
	http.Redirect(w, r, c.prefix+"/signin", http.StatusSeeOther)
}

// api is an operator API client for key that calls the API's handler in
// this process: the same path, authentication and authorization as the CLI.
func (c *Console) api(key string) *client.Client {
	cl, _ := client.New(client.Config{URL: "http://console.invalid" + "/" + strings.Trim(c.cfg.BasePath, "/"), APIKey: key,
		HTTPClient: &http.Client{Transport: inProcess{h: c.cfg.API}}})
	return cl
}

// inProcess is a RoundTripper that serves requests with a handler in this
// process (unary Connect calls: the answer is buffered whole).
type inProcess struct{ h http.Handler }

func (t inProcess) RoundTrip(r *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	r = r.Clone(r.Context())
	r.RemoteAddr = "127.0.0.1:0"
	r.RequestURI = r.URL.RequestURI()
	t.h.ServeHTTP(rec, r)
	res := rec.Result()
	res.Request = r
	return res, nil
}

func (c *Console) render(w http.ResponseWriter, status int, name string, data any) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	var b strings.Builder
	if err := c.tmpl.ExecuteTemplate(&b, name, data); err != nil {
		c.cfg.Log.Error("console template", "template", name, "err", err)
		http.Error(w, "internal error\n", http.StatusInternalServerError)
		return
	}
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func randomID() string { return base64.RawURLEncoding.EncodeToString(randomBytes(32)) }

// errText is what a page shows of an API error: its code and message.
func errText(err error) string {
	if e, ok := errs.As(err); ok {
		return string(e.Code) + ": " + e.Message
	}
	return err.Error()
}
