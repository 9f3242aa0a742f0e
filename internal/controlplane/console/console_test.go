package console_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/chromedp/chromedp"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/browser"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/console"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// plane is a real API (SQLite) served over TLS with a site, a pool, two
// pending discovery join requests and a key without grants.
type plane struct {
	e        *apitest.Env
	hs       *httptest.Server
	base     string // https://127.0.0.1:port/api/compute/console
	pool     *bcv1.Pool
	reqs     []store.JoinRequest
	emptyKey string
}

func newPlane(t *testing.T) *plane {
	t.Helper()
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{})
	hs := httptest.NewTLSServer(e.Server)
	t.Cleanup(hs.Close)
	ctx := context.Background()
	site, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	must(t, err)
	pool, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: site.Msg.Id, Name: "gpu", Agent: "bcd"}))
	must(t, err)
	// The API wants at least one grant: this one is on a pool that does
	// not exist, so the key is granted nothing of the tenant.
	k, err := e.Admin.APIKeys.CreateApiKey(ctx, connect.NewRequest(&bcv1.CreateApiKeyRequest{TenantId: e.RootTenant, Name: "nothing",
		Grants: []*bcv1.Grant{{Action: "compute:join-tokens:read", Resource: "compute-pool/pool_none"}}}))
	must(t, err)
	p := &plane{e: e, hs: hs, base: hs.URL + e.Server.BasePath() + "/console", pool: pool.Msg, emptyKey: k.Msg.Key}
	p.reqs = insertRequests(t, e.DB, pool.Msg, 4)
	return p
}

// insertRequests stores n pending discovery join requests as JoinService
// would after a site agent vouched for the machines.
func insertRequests(t testing.TB, db *store.DB, pool *bcv1.Pool, n int) []store.JoinRequest {
	t.Helper()
	ctx := context.Background()
	var out []store.JoinRequest
	base := time.Now()
	must(t, db.WithTx(ctx, func(tx *store.Tx) error {
		for i := range n {
			csr := sha256.Sum256(fmt.Appendf(nil, "csr %d %d", i, base.UnixNano()))
			r, err := tx.InsertJoinRequest(ctx, store.JoinRequest{ID: ids.New(ids.JoinRequest, base.Add(time.Duration(i)*time.Millisecond)), TenantID: pool.OwnerTenantId,
				PoolID: pool.Id, SiteID: pool.SiteId, Attestor: "discovery", Role: "ramdisk", MachineKey: fmt.Sprintf("mac:%d", i),
				Claims: fmt.Appendf(nil, `{"productSerial":"SN-%d","hostname":"pxe-%d"}`, i, i), HardwareKey: []byte{0xab, 0xcd, byte(i)},
				MAC: fmt.Sprintf("52:54:00:00:00:%02x", i), IP: "10.0.0.9", WorkflowID: "wf-9", VouchedBy: "node_site", BootLeaseEpoch: 7, CSRSHA256: csr[:]})
			if err != nil {
				return err
			}
			out = append(out, r)
		}
		return nil
	}))
	return out
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func (p *plane) requestState(t *testing.T, id string) string {
	t.Helper()
	res, err := p.e.Admin.JoinRequests.ListJoinRequests(context.Background(), connect.NewRequest(&bcv1.ListJoinRequestsRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id, State: []string{"all"}}))
	must(t, err)
	for _, r := range res.Msg.Items {
		if r.Id == id {
			return r.State
		}
	}
	return ""
}

// R18.2: in a browser, an operator signs in with an API key, approves two
// discovery join requests with one form and rejects a third, mints a join token and sees
// the machine that joins with it, then its node and the events; a key
// without grants sees nothing of the tenant.
func TestConsoleInBrowserR18_2(t *testing.T) {
	p := newPlane(t)
	ctx := browser.New(t, 40*time.Second)
	dir := browser.Artifacts(t, "console")
	q := "?tenant=" + p.e.RootTenant + "&pool=" + p.pool.Id
	row := func(id string) string { return `tr[data-id="` + id + `"]` }
	var notice, claims string
	var claimsHeight float64
	browser.Run(t, ctx,
		chromedp.Navigate(p.base+"/"),
		chromedp.WaitVisible(chromedp.CSS("#signin")),
		chromedp.SendKeys(chromedp.CSS("#key"), p.e.AdminKey),
		browser.Submit("#signin-submit"),
		chromedp.WaitVisible(chromedp.CSS(row(p.reqs[0].ID))),
		browser.Shot(t, dir, "join-requests.png"),
		browser.Text(row(p.reqs[0].ID)+" dl.fields", &claims),
		chromedp.Func(func(ctx context.Context, tg *chromedp.Target) (err error) {
			claimsHeight, err = chromedp.Evaluate[float64](`Math.max(...[...document.querySelectorAll('tr[data-id="`+p.reqs[0].ID+`"] dl.fields dd')].map(e => e.getBoundingClientRect().height))`)(ctx, tg)
			return err
		}),
		// Two at once: a bulk approval of a selection.
		chromedp.Click(chromedp.CSS(row(p.reqs[0].ID)+` input[type="checkbox"]`)),
		chromedp.Click(chromedp.CSS(row(p.reqs[1].ID)+` input[type="checkbox"]`)),
		chromedp.SendKeys(chromedp.CSS("#reason"), "intake 42"),
		browser.Submit("#approve"),
		chromedp.WaitNotPresent(chromedp.CSS(row(p.reqs[0].ID))),
		chromedp.WaitNotPresent(chromedp.CSS(row(p.reqs[1].ID))),
		browser.Text("#notice", &notice),
		chromedp.Click(chromedp.CSS(row(p.reqs[2].ID)+` input[type="checkbox"]`)),
		chromedp.SendKeys(chromedp.CSS("#reason"), "unknown serial"),
		browser.Submit("#reject"),
		chromedp.WaitNotPresent(chromedp.CSS(row(p.reqs[2].ID))),
		chromedp.Navigate(p.base+"/join-requests"+q+"&state=all"),
		chromedp.WaitVisible(chromedp.CSS(row(p.reqs[0].ID)+`[data-state="approved"]`)),
		chromedp.WaitVisible(chromedp.CSS(row(p.reqs[1].ID)+`[data-state="approved"]`)),
		chromedp.WaitVisible(chromedp.CSS(row(p.reqs[2].ID)+`[data-state="rejected"]`)),
	)
	// The claims are a list of key and value, each value on one line (the
	// JSON they were wrapped character by character in a narrow column).
	if !strings.Contains(claims, "productSerial") || !strings.Contains(claims, "SN-0") || strings.Contains(claims, `{"`) {
		t.Fatalf("claims cell %q: want a list of key and value", claims)
	}
	if claimsHeight <= 0 || claimsHeight > 24 {
		t.Fatalf("a claim's value is %.0f px high: wrapped, not one line", claimsHeight)
	}
	if notice != "2 approved" {
		t.Fatalf("notice after the bulk approval: %q", notice)
	}
	for i, want := range []string{"approved", "approved", "rejected", "pending"} {
		if got := p.requestState(t, p.reqs[i].ID); got != want {
			t.Fatalf("request %d: state %q, want %q", i, got, want)
		}
	}

	// A token, its install command, and the join it waits for.
	var install, shown, title string
	browser.Run(t, ctx,
		chromedp.Navigate(p.base+"/tokens"+q),
		browser.Submit("#create-token"),
		chromedp.WaitVisible(chromedp.CSS("#install")),
		browser.Text("#install", &install),
		browser.Text("#token", &shown),
		chromedp.WaitVisible(chromedp.CSS("#joined.waiting")),
		chromedp.Func(func(ctx context.Context, tg *chromedp.Target) (err error) {
			title, err = chromedp.Title()(ctx, tg)
			return err
		}),
	)
	if title != "Join tokens — better-compute console" {
		t.Fatalf("page title %q", title)
	}
	// R24.1: the token is shown apart; the command never carries it.
	token := regexp.MustCompile(`bcjt_[A-Za-z0-9_.-]+`).FindString(shown)
	if token == "" || strings.Contains(install, "bcjt_") || !strings.Contains(install, "bcd join --token-file ./join-token") {
		t.Fatalf("token %q, install command %q", shown, install)
	}
	// Another machine joins the pool first, with a token minted elsewhere:
	// the page waits on, and then names, the machine that used its token.
	other, err := p.e.Admin.JoinTokens.CreateJoinToken(context.Background(), connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id, TtlSeconds: 600}))
	must(t, err)
	om := jointest.NewMachine(t, jointest.Claims(2))
	ores, err := p.e.Server.Join().Join(context.Background(), om.Request(t, p.e.Bundle, other.Msg.Token, ""), join.Peer{Addr: "192.0.2.8:40000"})
	must(t, err)
	otherID := om.Verify(t, p.e.Bundle, ores, "").Body.NodeId
	m := jointest.NewMachine(t, jointest.Claims(1))
	res, err := p.e.Server.Join().Join(context.Background(), m.Request(t, p.e.Bundle, token, ""), join.Peer{Addr: "192.0.2.7:40000"})
	must(t, err)
	nodeID := m.Verify(t, p.e.Bundle, res, "").Body.NodeId
	var joined string
	browser.Run(t, ctx,
		chromedp.WaitVisible(chromedp.CSS("#joined.joined")),
		browser.Text("#joined", &joined),
		browser.Shot(t, dir, "token-joined.png"),
	)
	if !strings.Contains(joined, nodeID) || strings.Contains(joined, otherID) {
		t.Fatalf("token page shows %q, want node %s (not %s, which joined with another token)", joined, nodeID, otherID)
	}
	// Events are rows whose data is a list of its fields; one that happens
	// while the page is open is added the same way.
	var events, first string
	browser.Run(t, ctx,
		chromedp.Navigate(p.base+"/nodes"+q),
		chromedp.WaitVisible(chromedp.CSS(row(nodeID))),
		browser.Shot(t, dir, "nodes.png"),
		chromedp.Navigate(p.base+"/events"+q),
		chromedp.WaitVisible(chromedp.CSS("#events tbody tr dl.fields dt")),
		browser.Text("#events", &events),
	)
	if !strings.Contains(events, nodeID) || !strings.Contains(events, "joinTokenId") || strings.Contains(events, `{"`) {
		t.Fatalf("events page: want rows with node %s and the fields of their data, got %q", nodeID, events)
	}
	_, err = p.e.Admin.JoinTokens.RevokeJoinToken(context.Background(), connect.NewRequest(&bcv1.RevokeJoinTokenRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id, TokenId: other.Msg.Id}))
	must(t, err)
	browser.Run(t, ctx,
		chromedp.WaitVisible(chromedp.CSS("#events tbody tr:first-child dl.fields dt")),
		chromedp.Poll[chromedp.Void](`document.querySelector("#events tbody tr:first-child").textContent.includes("`+other.Msg.Id+`")`),
		browser.Text("#events tbody tr:first-child", &first),
		browser.Shot(t, dir, "events.png"),
	)
	if strings.Contains(first, `{"`) {
		t.Fatalf("a polled event row shows raw JSON: %q", first)
	}

	// Sign out, then in with a key that has no grants: the API refuses it
	// everything, and the page shows none of the tenant's requests.
	var page string
	browser.Run(t, ctx,
		browser.Submit("#signout"),
		chromedp.WaitVisible(chromedp.CSS("#signin")),
		chromedp.Navigate(p.base+"/join-requests"+q),
		chromedp.WaitVisible(chromedp.CSS("#signin")),
		chromedp.SendKeys(chromedp.CSS("#key"), p.emptyKey),
		browser.Submit("#signin-submit"),
		chromedp.WaitVisible(chromedp.CSS("#join-requests")),
		chromedp.Navigate(p.base+"/join-requests"+q),
		chromedp.WaitVisible(chromedp.CSS("#error")),
		chromedp.Func(func(ctx context.Context, tg *chromedp.Target) (err error) {
			page, err = chromedp.OuterHTML(chromedp.CSS("html"))(ctx, tg)
			return err
		}),
	)
	if strings.Contains(page, p.reqs[3].ID) || strings.Contains(page, "SN-3") {
		t.Fatal("a key without grants sees the tenant's join requests")
	}
	if !strings.Contains(page, "ACCESS_DENIED") {
		t.Fatalf("no API refusal on the page: %s", regexp.MustCompile(`<p class="error" id="error">[^<]*`).FindString(page))
	}
}

// httpClient is a browser-like client of the test server: it keeps
// cookies (they are Secure: the server is TLS) and does not follow
// redirects.
func httpClient(p *plane) *http.Client {
	jar, _ := cookiejar.New(nil)
	c := *p.hs.Client()
	c.Jar = jar
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &c
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func get(t *testing.T, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	res, err := c.Get(u)
	must(t, err)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	return res, string(b)
}

func post(t *testing.T, c *http.Client, u string, form url.Values) int {
	t.Helper()
	res, err := c.PostForm(u, form)
	must(t, err)
	res.Body.Close()
	return res.StatusCode
}

// postBody posts form and returns the page the browser ends on (it follows
// one redirect, as the console answers an action).
func postBody(t *testing.T, c *http.Client, u string, form url.Values) (int, string) {
	t.Helper()
	res, err := c.PostForm(u, form)
	must(t, err)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusSeeOther {
		return res.StatusCode, string(b)
	}
	next, err := res.Location()
	must(t, err)
	res, body := get(t, c, next.String())
	return res.StatusCode, body
}

// signIn signs c in with key and returns the session's CSRF token.
func signIn(t *testing.T, p *plane, c *http.Client, key string) string {
	t.Helper()
	_, body := get(t, c, p.base+"/signin")
	m := csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatal("no CSRF token on the sign-in form")
	}
	if got := post(t, c, p.base+"/signin", url.Values{"csrf": {m[1]}, "key": {key}}); got != http.StatusSeeOther {
		t.Fatalf("sign in: %d", got)
	}
	_, body = get(t, c, p.base+"/join-requests")
	m = csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatal("no CSRF token on the page")
	}
	return m[1]
}

// R18.2: every form POST needs the session's CSRF token (missing or wrong:
// 403, and nothing changes; revoke needs it too); every answer has the strict CSP; the session
// cookie is HttpOnly, Secure and SameSite=Strict; a wrong key does not
// sign in.
func TestConsoleCSRFAndHeadersR18_2(t *testing.T) {
	p := newPlane(t)
	c := httpClient(p)

	if got := post(t, c, p.base+"/signin", url.Values{"key": {p.e.AdminKey}}); got != http.StatusForbidden {
		t.Fatalf("sign in without CSRF token: %d, want 403", got)
	}
	_, body := get(t, c, p.base+"/signin")
	tok := csrfField.FindStringSubmatch(body)[1]
	if got := post(t, c, p.base+"/signin", url.Values{"csrf": {tok}, "key": {"bck_key_wrong.nope"}}); got != http.StatusUnauthorized {
		t.Fatalf("sign in with a wrong key: %d, want 401", got)
	}
	csrf := signIn(t, p, c, p.e.AdminKey)
	u, _ := url.Parse(p.base + "/")
	var session *http.Cookie
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == "bc_console" {
			session = ck
		}
	}
	if session == nil {
		t.Fatal("no session cookie")
	}
	res, err := c.Get(p.base + "/signin")
	must(t, err)
	res.Body.Close()

	decide := func(csrf string) url.Values {
		v := url.Values{"tenant": {p.e.RootTenant}, "pool": {p.pool.Id}, "id": {p.reqs[0].ID}, "action": {"reject"}, "reason": {"x"}, "ttl": {"3600"}}
		if csrf != "" {
			v.Set("csrf", csrf)
		}
		return v
	}
	for _, tc := range []struct {
		name, path string
		form       url.Values
	}{
		{"decide without token", "/join-requests", decide("")},
		{"decide with a wrong token", "/join-requests", decide("AAAA" + csrf[4:])},
		{"create token without token", "/tokens/create", url.Values{"tenant": {p.e.RootTenant}, "pool": {p.pool.Id}, "ttl": {"600"}}},
		{"sign out with a wrong token", "/signout", url.Values{"csrf": {"nope"}}},
	} {
		if got := post(t, c, p.base+tc.path, tc.form); got != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", tc.name, got)
		}
	}
	if got := p.requestState(t, p.reqs[0].ID); got != "pending" {
		t.Fatalf("a refused POST changed the request: %q", got)
	}
	if got := post(t, c, p.base+"/join-requests", decide(csrf)); got != http.StatusSeeOther {
		t.Fatalf("decide with the token: %d", got)
	}
	if got := p.requestState(t, p.reqs[0].ID); got != "rejected" {
		t.Fatalf("after a good POST: %q", got)
	}
	tok2, err := p.e.Admin.JoinTokens.CreateJoinToken(context.Background(), connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id, TtlSeconds: 600}))
	must(t, err)
	revoke := url.Values{"tenant": {p.e.RootTenant}, "pool": {p.pool.Id}, "token": {tok2.Msg.Id}}
	if got := post(t, c, p.base+"/tokens/revoke", revoke); got != http.StatusForbidden {
		t.Fatalf("revoke without a CSRF token: %d", got)
	}
	revoke.Set("csrf", csrf)
	if got := post(t, c, p.base+"/tokens/revoke", revoke); got != http.StatusSeeOther {
		t.Fatalf("revoke: %d", got)
	}
	list, err := p.e.Admin.JoinTokens.ListJoinTokens(context.Background(), connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id, IncludeInactive: true}))
	must(t, err)
	if len(list.Msg.Items) != 1 || list.Msg.Items[0].State != "revoked" {
		t.Fatalf("after revoke: %v", list.Msg.Items)
	}
	// The same create form sent twice (a reload after the POST) makes one
	// token, and the second answer shows no secret.
	create := url.Values{"csrf": {csrf}, "tenant": {p.e.RootTenant}, "pool": {p.pool.Id}, "ttl": {"600"}, "uses": {"1"}, "idem": {"form-1"}}
	_, first := postBody(t, c, p.base+"/tokens/create", create)
	_, again := postBody(t, c, p.base+"/tokens/create", create)
	if !strings.Contains(first, "The secret is shown only now") || strings.Contains(again, "The secret is shown only now") ||
		!strings.Contains(again, "this form was already sent") {
		t.Fatalf("a resent create form: first %q\nagain %q", first, again)
	}
	list, err = p.e.Admin.JoinTokens.ListJoinTokens(context.Background(), connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: p.e.RootTenant,
		PoolId: p.pool.Id}))
	must(t, err)
	if len(list.Msg.Items) != 1 {
		t.Fatalf("a resent create form made %d live tokens, want 1", len(list.Msg.Items))
	}
	q := "?tenant=" + p.e.RootTenant + "&pool=" + p.pool.Id
	for _, path := range []string{"/signin", "/join-requests" + q, "/tokens" + q, "/nodes" + q, "/events" + q, "/events.json" + q,
		"/tokens/joined.json" + q, "/static/console.css", "/static/console.js", "/static/favicon.svg", "/nope"} {
		res, _ := get(t, c, p.base+path)
		h := res.Header
		if h.Get("Content-Security-Policy") != console.CSP || h.Get("X-Content-Type-Options") != "nosniff" || h.Get("Referrer-Policy") != "no-referrer" {
			t.Errorf("%s: headers %v", path, h)
		}
		if res.StatusCode != http.StatusOK && path != "/nope" {
			t.Errorf("%s: %d", path, res.StatusCode)
		}
	}
	// The pages name their icon; a browser that asks for /favicon.ico
	// first gets no 404.
	if _, body := get(t, c, p.base+"/tokens"+q); !strings.Contains(body, `<link rel="icon" href="`+p.e.Server.BasePath()+`/console/static/favicon.svg"`) {
		t.Error("the page links no icon")
	}
	if res, _ := get(t, c, p.hs.URL+"/favicon.ico"); res.StatusCode == http.StatusNotFound {
		t.Errorf("/favicon.ico: %d", res.StatusCode)
	}
	// The cookie's attributes as the server set them.
	c2 := httpClient(p)
	_, body = get(t, c2, p.base+"/signin")
	tok = csrfField.FindStringSubmatch(body)[1]
	res, err = c2.PostForm(p.base+"/signin", url.Values{"csrf": {tok}, "key": {p.e.AdminKey}})
	must(t, err)
	res.Body.Close()
	set := strings.Join(res.Header.Values("Set-Cookie"), "\n")
	if !regexp.MustCompile(`bc_console=[^;]+;.*HttpOnly; Secure; SameSite=Strict`).MatchString(set) {
		t.Fatalf("session cookie %q", set)
	}
	// Signed out, the session is gone.
	if got := post(t, c, p.base+"/signout", url.Values{"csrf": {csrf}}); got != http.StatusSeeOther {
		t.Fatalf("sign out: %d", got)
	}
	res, _ = get(t, c, p.base+"/nodes"+q)
	if res.StatusCode != http.StatusSeeOther {
		t.Fatalf("after sign out: %d, want a redirect to sign in", res.StatusCode)
	}
}

// insertReview stores what an operator reviews (R22): a node, a vouched
// ramdisk's request that reclaims it (copied claims), and two tpm requests
// with the same claims and different EKs.
func insertReview(t *testing.T, p *plane) (victim string, reclaim store.JoinRequest, tpms []store.JoinRequest) {
	t.Helper()
	ctx := context.Background()
	claims := []byte(`{"productSerial":"SN-VICTIM","macs":["00:1b:21:00:00:99"],"hostname":"db-9"}`)
	same := []byte(`{"productUuid":"4c4c4544-0042-3510-8052-b7c04f000001","productSerial":"SN-CLONE","hostname":"clone"}`)
	must(t, p.e.DB.WithTx(ctx, func(tx *store.Tx) error {
		n, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, time.Now()), TenantID: p.e.RootTenant, SiteID: p.pool.SiteId, PoolID: p.pool.Id,
			Role: "node", State: store.NodeAdopted, Connection: "disconnected", IdentityGeneration: 1, HardwareKey: []byte{0x99}, HardwareKeyTrusted: true,
			NodeKey: "unattested", Attestor: "join-token", Hostname: "db-9", Claims: claims})
		if err != nil {
			return err
		}
		victim = n.ID
		// A tpm node admitted earlier, whose EK an approver compares
		// with the requests'.
		tn, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, time.Now()), TenantID: p.e.RootTenant, SiteID: p.pool.SiteId, PoolID: p.pool.Id,
			Role: "node", State: store.NodeAdopted, Connection: "disconnected", IdentityGeneration: 1, NodeKey: "tpm", Attestor: "tpm", Hostname: "tpm-1", Claims: same})
		if err != nil {
			return err
		}
		if err := tx.SetNodeTPMAK(ctx, p.e.RootTenant, "urn:bc:tpm-ak:console", tn.ID, bytes.Repeat([]byte{0x3f}, 32)); err != nil {
			return err
		}
		reclaim, err = tx.InsertJoinRequest(ctx, store.JoinRequest{ID: ids.New(ids.JoinRequest, time.Now()), TenantID: p.e.RootTenant, PoolID: p.pool.Id,
			SiteID: p.pool.SiteId, Attestor: "discovery", Role: "ramdisk", MachineKey: "mac:victim", Claims: claims, HardwareKey: []byte{0x99},
			MAC: "00:1b:21:00:00:99", IP: "10.0.0.99", VouchedBy: "node_site", BootLeaseEpoch: 5, CSRSHA256: bytes.Repeat([]byte{9}, 32), Source: "10.0.0.99",
			Effect: store.JoinEffectReclaim, EffectNodeID: victim})
		if err != nil {
			return err
		}
		for i, ek := range []byte{0x3f, 0xc2} {
			r, err := tx.InsertJoinRequest(ctx, store.JoinRequest{ID: ids.New(ids.JoinRequest, time.Now().Add(time.Duration(i+1)*time.Millisecond)),
				TenantID: p.e.RootTenant, PoolID: p.pool.Id, SiteID: p.pool.SiteId, Attestor: "tpm", Role: "node", MachineKey: fmt.Sprintf("ek:%x", ek),
				Claims: same, HardwareKey: bytes.Repeat([]byte{0x5a}, 32), EKHash: bytes.Repeat([]byte{ek}, 32), EKCert: store.EKCertUntrusted,
				EKCertSubject: "", EKCertIssuer: fmt.Sprintf("CN=swtpm-localca-%d", i+1), AKName: append([]byte{0, 0xb}, bytes.Repeat([]byte{ek + 1}, 32)...),
				CSRSHA256: bytes.Repeat([]byte{ek}, 32), Source: "192.0.2.9", Effect: store.JoinEffectNew})
			if err != nil {
				return err
			}
			tpms = append(tpms, r)
		}
		return nil
	}))
	return victim, reclaim, tpms
}

// R22.1, R22.2: in a browser, the join requests page shows two tpm
// requests with the same claims apart by their EKs and a reclaim as a
// warning; approving the reclaim without ticking its confirmation shows
// the API's refusal and leaves it pending, and with it approves.
func TestConsoleReclaimInBrowserR22_2(t *testing.T) {
	p := newPlane(t)
	victim, reclaim, tpms := insertReview(t, p)
	ctx := browser.New(t, 40*time.Second)
	dir := browser.Artifacts(t, "console")
	row := func(id string) string { return `tr[data-id="` + id + `"]` }
	var failure, notice, same string
	browser.Run(t, ctx,
		chromedp.Navigate(p.base+"/"),
		chromedp.WaitVisible(chromedp.CSS("#signin")),
		chromedp.SendKeys(chromedp.CSS("#key"), p.e.AdminKey),
		browser.Submit("#signin-submit"),
		chromedp.WaitVisible(chromedp.CSS(row(reclaim.ID)+`[data-effect="reclaim"]`)),
		browser.Text(row(tpms[0].ID)+" td.effect", &same),
		browser.Shot(t, dir, "join-requests-review.png"),
		chromedp.Click(chromedp.CSS(row(reclaim.ID)+` input[name="id"]`)),
		chromedp.SendKeys(chromedp.CSS("#reason"), "disk replaced"),
		browser.Submit("#approve"),
		browser.Text("#error", &failure),
		chromedp.Click(chromedp.CSS(row(reclaim.ID)+` input[name="id"]`)),
		chromedp.Click(chromedp.CSS(row(reclaim.ID)+` input[name="reclaim-`+reclaim.ID+`"]`)),
		chromedp.SendKeys(chromedp.CSS("#reason"), "disk replaced"),
		browser.Submit("#approve"),
		chromedp.WaitNotPresent(chromedp.CSS(row(reclaim.ID))),
		browser.Text("#notice", &notice),
	)
	if !strings.Contains(same, "Same claims as "+tpms[1].ID) {
		t.Errorf("the first tpm request's effect %q: want it to name %s", same, tpms[1].ID)
	}
	if !strings.Contains(failure, "reclaims node "+victim) {
		t.Errorf("the unconfirmed approval's error %q: want the node named", failure)
	}
	if notice != "1 approved" {
		t.Errorf("notice after the confirmed approval: %q", notice)
	}
	if got := p.requestState(t, reclaim.ID); got != "approved" {
		t.Fatalf("the reclaim request: %q, want approved", got)
	}
}

// R22.1, R22.2: the join requests page shows each request's evidence apart
// from its claims, and a reclaim as a warning naming the node with its
// serials and MACs and a confirmation; approving the reclaim without the
// confirmation fails with the API's message and changes nothing, and with
// it approves; an approval of a request refreshed after the page showed
// it is refused as stale. The nodes page shows serials, MACs and a tpm
// node's EK hash.
func TestConsoleReclaimConfirmationR22_2(t *testing.T) {
	p := newPlane(t)
	c := httpClient(p)
	csrf := signIn(t, p, c, p.e.AdminKey)
	ctx := context.Background()
	victim, reclaim, _ := insertReview(t, p)
	_, page := get(t, c, p.base+"/join-requests?tenant="+p.e.RootTenant+"&pool="+p.pool.Id)
	for _, want := range []string{"Evidence (attestor)", "Claims (machine)", "Hardware key (from claims)", "vouched by <code>node_site</code>, lease 5",
		"peer 10.0.0.99", "Reclaims <code>" + victim + "</code>", "serials SN-VICTIM", "MACs 00:1b:21:00:00:99", `name="reclaim-` + reclaim.ID + `" value="` + victim + `"`,
		`name="version-` + reclaim.ID + `"`} {
		if !strings.Contains(page, want) {
			t.Errorf("join requests page lacks %q", want)
		}
	}
	version := regexp.MustCompile(`name="version-` + reclaim.ID + `" value="([^"]+)"`).FindStringSubmatch(page)[1]
	form := func(extra ...string) url.Values {
		v := url.Values{"csrf": {csrf}, "tenant": {p.e.RootTenant}, "pool": {p.pool.Id}, "id": {reclaim.ID}, "action": {"approve"}, "reason": {"disk replaced"},
			"ttl": {"900"}, "version-" + reclaim.ID: {version}}
		for i := 0; i+1 < len(extra); i += 2 {
			v.Set(extra[i], extra[i+1])
		}
		return v
	}
	if _, body := postBody(t, c, p.base+"/join-requests", form()); !strings.Contains(body, "reclaims node "+victim) || !strings.Contains(body, "0 approved") {
		t.Fatalf("an unconfirmed reclaim: want the API's refusal naming %s", victim)
	}
	if got := p.requestState(t, reclaim.ID); got != "pending" {
		t.Fatalf("after an unconfirmed approval: %q", got)
	}
	// The machine refreshed its request after the page showed it.
	must(t, p.e.DB.WithTx(ctx, func(tx *store.Tx) error {
		r := reclaim
		r.CSRSHA256 = bytes.Repeat([]byte{8}, 32)
		_, err := tx.RefreshJoinRequest(ctx, r)
		return err
	}))
	if _, body := postBody(t, c, p.base+"/join-requests", form("reclaim-"+reclaim.ID, victim)); !strings.Contains(body, "changed since it was listed") {
		t.Fatal("a confirmed approval of a refreshed request: want it refused as stale")
	}
	_, page = get(t, c, p.base+"/join-requests?tenant="+p.e.RootTenant+"&pool="+p.pool.Id)
	version = regexp.MustCompile(`name="version-` + reclaim.ID + `" value="([^"]+)"`).FindStringSubmatch(page)[1]
	if _, body := postBody(t, c, p.base+"/join-requests", form("reclaim-"+reclaim.ID, victim, "version-"+reclaim.ID, version)); !strings.Contains(body, "1 approved") {
		t.Fatal("the confirmed approval: want it approved")
	}
	_, page = get(t, c, p.base+"/join-requests?tenant="+p.e.RootTenant+"&pool="+p.pool.Id+"&state=all")
	if !strings.Contains(page, "reclaim of "+victim+" confirmed") {
		t.Error("the decided request does not say the reclaim was confirmed")
	}
	_, page = get(t, c, p.base+"/nodes?tenant="+p.e.RootTenant+"&pool="+p.pool.Id)
	if !strings.Contains(page, `<td class="serials">SN-VICTIM</td><td class="macs">00:1b:21:00:00:99</td>`) {
		t.Error("the nodes page lacks the node's serials and MACs")
	}
	if ek := strings.Repeat("3f", 32); !strings.Contains(page, `<td class="ek"><code title="`+ek+`">`+ek+`</code></td>`) {
		t.Error("the nodes page lacks the tpm node's EK hash")
	}
}
