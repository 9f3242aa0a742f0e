package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/cli"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// result is one run of the CLI.
type result struct {
	code           int
	stdout, stderr string
}

// run runs cli.Main in-process with env as its whole environment.
func run(t testing.TB, env map[string]string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	code := cli.Main(context.Background(), args, cli.Env{
		Stdin:  strings.NewReader(""),
		Stdout: &out,
		Stderr: &errb,
		Getenv: func(k string) string { return env[k] },
	})
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

// ok fails the test unless r succeeded.
func (r result) ok(t testing.TB) result {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	return r
}

var errLine = regexp.MustCompile(`^Error: ([A-Z_]+): (.+)\n$`)

// fails checks the R3.6 error form: exit 1, nothing on stdout, one
// "Error: CODE: message" line on stderr whose message holds every want.
func (r result) fails(t testing.TB, code string, want ...string) {
	t.Helper()
	if r.code != 1 {
		t.Fatalf("exit %d, want 1\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	m := errLine.FindStringSubmatch(r.stderr)
	if m == nil {
		t.Fatalf("stderr %q is not one \"Error: CODE: message\" line", r.stderr)
	}
	if m[1] != code {
		t.Fatalf("code %s, want %s: %q", m[1], code, r.stderr)
	}
	for _, w := range want {
		if !strings.Contains(m[2], w) {
			t.Fatalf("message %q does not mention %q", m[2], w)
		}
	}
	if r.stdout != "" {
		t.Fatalf("stdout on error: %q", r.stdout)
	}
}

// decode parses r's stdout as the protobuf JSON of m.
func (r result) decode(t testing.TB, m proto.Message) {
	t.Helper()
	if err := protojson.Unmarshal([]byte(r.stdout), m); err != nil {
		t.Fatalf("stdout is not %T JSON: %v\n%s", m, err, r.stdout)
	}
}

// world is a running API with a root tenant's site and bcd pool, and a
// second tenant "acme" with its own key, site and pool.
type world struct {
	e        *apitest.Env
	env      map[string]string // the root admin's CLI environment
	root     string
	site     string
	pool     string
	acme     string
	acmeKey  string
	acmePool string
}

func newWorld(t *testing.T, e *apitest.Env) *world {
	t.Helper()
	w := &world{e: e, root: e.RootTenant, env: map[string]string{"BETTER_COMPUTE_URL": e.URL, "BETTER_COMPUTE_API_KEY": e.AdminKey}}
	var s bcv1.Site
	w.cli(t, "sites", "create", "eu-1", "--tenant", w.root, "--json").ok(t).decode(t, &s)
	w.site = s.Id
	w.pool = w.mkPool(t, "gpu")
	var tn bcv1.Tenant
	w.cli(t, "tenants", "create", "acme", "--json").ok(t).decode(t, &tn)
	w.acme = tn.Id
	var k bcv1.CreateApiKeyResponse
	w.cli(t, "api-keys", "create", "acme-admin", "--tenant", w.acme, "--grant", "*=*", "--json").ok(t).decode(t, &k)
	w.acmeKey = k.Key
	acme := w.as(w.acmeKey)
	var as bcv1.Site
	run(t, acme, "sites", "create", "acme-dc", "--tenant", w.acme, "--json").ok(t).decode(t, &as)
	var ap bcv1.Pool
	run(t, acme, "pools", "create", "acme-gpu", "--tenant", w.acme, "--site", as.Id, "--json").ok(t).decode(t, &ap)
	w.acmePool = ap.Id
	return w
}

// cli runs the CLI as the root admin.
func (w *world) cli(t testing.TB, args ...string) result {
	t.Helper()
	return run(t, w.env, args...)
}

// as returns the CLI environment of another API key.
func (w *world) as(key string) map[string]string {
	return map[string]string{"BETTER_COMPUTE_URL": w.e.URL, "BETTER_COMPUTE_API_KEY": key}
}

func (w *world) mkPool(t testing.TB, name string) string {
	t.Helper()
	var p bcv1.Pool
	w.cli(t, "pools", "create", name, "--tenant", w.root, "--site", w.site, "--json").ok(t).decode(t, &p)
	return p.Id
}

// tokens lists a pool's tokens through join-tokens list --json.
func (w *world) tokens(t testing.TB, pool string, all bool) []*bcv1.JoinToken {
	t.Helper()
	args := []string{"join-tokens", "list", "--tenant", w.root, "--pool", pool, "--json"}
	if all {
		args = append(args, "--all")
	}
	var l bcv1.ListJoinTokensResponse
	w.cli(t, args...).ok(t).decode(t, &l)
	return l.Items
}

// mkTokens creates n tokens through the API client, in parallel.
func (w *world) mkTokens(t testing.TB, pool string, n int, ttl int32) []*bcv1.JoinToken {
	t.Helper()
	out := make([]*bcv1.JoinToken, n)
	errv := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			r, err := w.e.Admin.JoinTokens.CreateJoinToken(context.Background(), connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: pool, TtlSeconds: ttl, MaxUses: 1}))
			if errv[i] = err; err == nil {
				out[i] = r.Msg
			}
		})
	}
	wg.Wait()
	for _, err := range errv {
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

var tokenFile = regexp.MustCompile(`^bcjt_(jt_[0-9A-Za-z]+)\.([A-Za-z0-9_-]{43})\n$`)

// R3.2: --ttl is a duration from 1m to 24h in whole seconds; anything else is
// refused before a token is minted.
func TestJoinTokensCreateTTL(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		cases := []struct {
			ttl  string
			secs int64 // 0: refused
		}{
			{"1h", 3600},
			{"1m", 60},
			{"24h", 86400},
			{"90s", 90},
			{"59s", 0},
			{"24h1s", 0},
			{"1.5s", 0},
			{"1m0.5s", 0},
			{"abc", 0},
			{"0", 0},
			{"-1h", 0},
			{"", 0},
		}
		for _, c := range cases {
			t.Run(c.ttl, func(t *testing.T) {
				pool := w.mkPool(t, "ttl-"+strings.NewReplacer(".", "-").Replace(c.ttl))
				r := w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", pool, "--ttl", c.ttl, "--json")
				if c.secs == 0 {
					r.fails(t, "INVALID_ARGUMENT", "--ttl")
					if got := w.tokens(t, pool, true); len(got) != 0 {
						t.Fatalf("a refused --ttl minted %d tokens", len(got))
					}
					return
				}
				var tok bcv1.JoinToken
				r.ok(t).decode(t, &tok)
				if got := tok.ExpiresAt.AsTime().Sub(tok.CreatedAt.AsTime()); got < time.Duration(c.secs)*time.Second-time.Second || got > time.Duration(c.secs)*time.Second+time.Second {
					t.Fatalf("expiresAt - createdAt = %s, want %ds", got, c.secs)
				}
				if len(w.tokens(t, pool, true)) != 1 {
					t.Fatal("want one token")
				}
			})
		}
	})
}

// R3.2: --out creates a new 0600 file holding the token and nothing else,
// never overwrites, and refuses a replayed --key whose answer has no token.
func TestJoinTokensCreateOut(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		dir := t.TempDir()
		path := filepath.Join(dir, "join-token")
		create := []string{"join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--ttl", "1h", "--expect-serial", "SN-7701", "--key", "adopt-rack-b7-u12", "--out", path}

		r := w.cli(t, create...).ok(t)
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Fatalf("mode %v, want 0600", fi.Mode().Perm())
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		m := tokenFile.FindStringSubmatch(string(data))
		if m == nil {
			t.Fatalf("file holds %q, want bcjt_jt_….<secret>\\n", data)
		}
		if strings.Contains(r.stdout, "bcjt_") || strings.Contains(r.stdout, m[2]) || strings.Contains(r.stderr, m[2]) {
			t.Fatalf("the token is printed:\n%s%s", r.stdout, r.stderr)
		}
		if !strings.Contains(r.stdout, path) || !strings.Contains(r.stdout, m[1]) {
			t.Fatalf("output names neither the file nor the id:\n%s", r.stdout)
		}
		toks := w.tokens(t, w.pool, true)
		if len(toks) != 1 || toks[0].Id != m[1] || toks[0].GetExpect().GetSerial() != "SN-7701" {
			t.Fatalf("tokens after create: %v", toks)
		}

		t.Run("same command again: ALREADY_EXISTS", func(t *testing.T) {
			w.cli(t, create...).fails(t, "ALREADY_EXISTS", path)
			if again, _ := os.ReadFile(path); !bytes.Equal(again, data) {
				t.Fatalf("file changed: %q", again)
			}
			if n := len(w.tokens(t, w.pool, true)); n != 1 {
				t.Fatalf("%d tokens, want 1", n)
			}
		})

		t.Run("replayed --key with another --out: INVALID_STATE", func(t *testing.T) {
			other := filepath.Join(dir, "other")
			args := append(append([]string{}, create[:len(create)-1]...), other)
			w.cli(t, args...).fails(t, "INVALID_STATE", "adopt-rack-b7-u12", m[1], "revoke", "create a new one")
			if _, err := os.Lstat(other); !os.IsNotExist(err) {
				t.Fatalf("%s was created: %v", other, err)
			}
			if n := len(w.tokens(t, w.pool, true)); n != 1 {
				t.Fatalf("%d tokens, want 1", n)
			}
		})

		t.Run("replayed --key without --out: the record, no secret", func(t *testing.T) {
			args := slices.Clone(create[:len(create)-2])
			r := w.cli(t, args...).ok(t)
			if strings.Contains(r.stdout, "bcjt_") || !strings.Contains(r.stdout, m[1]) || !strings.Contains(r.stdout, "not shown again") {
				t.Fatalf("replay output:\n%s", r.stdout)
			}
			var tok bcv1.JoinToken
			w.cli(t, slices.Concat(args, []string{"--json"})...).ok(t).decode(t, &tok)
			if tok.Id != m[1] || tok.Token != "" {
				t.Fatalf("replay answer %v", &tok)
			}
		})

		t.Run("--json with --out: no token in the output", func(t *testing.T) {
			p := filepath.Join(dir, "json-token")
			r := w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--out", p, "--json").ok(t)
			var tok bcv1.JoinToken
			r.decode(t, &tok)
			if tok.Token != "" || strings.Contains(r.stdout, "bcjt_") {
				t.Fatalf("JSON holds the token:\n%s", r.stdout)
			}
			data, _ := os.ReadFile(p)
			if mm := tokenFile.FindStringSubmatch(string(data)); mm == nil || mm[1] != tok.Id {
				t.Fatalf("file %q does not hold token %s", data, tok.Id)
			}
		})

		t.Run("without --out the token is printed once", func(t *testing.T) {
			r := w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool).ok(t)
			if n := strings.Count(r.stdout, "bcjt_jt_"); n != 1 {
				t.Fatalf("token shown %d times:\n%s", n, r.stdout)
			}
			var tok bcv1.JoinToken
			w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &tok)
			if !strings.HasPrefix(tok.Token, "bcjt_"+tok.Id+".") {
				t.Fatalf("JSON token %q", tok.Token)
			}
		})

		t.Run("--out into a missing directory mints nothing", func(t *testing.T) {
			before := len(w.tokens(t, w.pool, true))
			r := w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--out", filepath.Join(dir, "missing", "tok"))
			if r.code != 1 {
				t.Fatalf("exit %d", r.code)
			}
			if after := len(w.tokens(t, w.pool, true)); after != before {
				t.Fatalf("minted %d tokens that could not be saved", after-before)
			}
		})
	})
}

// R3.2: the flags map to the token's fields.
func TestJoinTokensCreateFlags(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		cases := []struct {
			name  string
			args  []string
			check func(*bcv1.JoinToken) bool
		}{
			{"defaults", nil, func(j *bcv1.JoinToken) bool {
				return j.MaxUses == 1 && j.UsesLeft == 1 && !j.AllowReclaim && j.Hosted == "" && proto.Equal(j.GetExpect(), &bcv1.Expect{}) && j.Role == "node" && j.SiteId == w.site
			}},
			{"max-uses", []string{"--max-uses", "5"}, func(j *bcv1.JoinToken) bool { return j.MaxUses == 5 && j.UsesLeft == 5 }},
			{"allow-reclaim", []string{"--allow-reclaim"}, func(j *bcv1.JoinToken) bool { return j.AllowReclaim }},
			{"expect-serial", []string{"--expect-serial", "SN-7701"}, func(j *bcv1.JoinToken) bool { return j.GetExpect().GetSerial() == "SN-7701" }},
			{"expect-product-uuid", []string{"--expect-product-uuid", "4c4c4544-0035-3510-8052-b7c04f4d3232"}, func(j *bcv1.JoinToken) bool {
				return j.GetExpect().GetProductUuid() == "4c4c4544-0035-3510-8052-b7c04f4d3232"
			}},
			{"expect-mac", []string{"--expect-mac", "0c:42:a1:00:11:22"}, func(j *bcv1.JoinToken) bool { return j.GetExpect().GetMac() == "0c:42:a1:00:11:22" }},
			{"expect-gpu-uuid", []string{"--expect-gpu-uuid", "GPU-5d1a7c3e-0000-1111-2222-333344445555"}, func(j *bcv1.JoinToken) bool {
				return strings.EqualFold(j.GetExpect().GetGpuUuid(), "GPU-5d1a7c3e-0000-1111-2222-333344445555")
			}},
			{"hosted", []string{"--hosted", "kubernetes"}, func(j *bcv1.JoinToken) bool { return j.Hosted == "kubernetes" }},
			{"all-together", []string{"--max-uses", "3", "--allow-reclaim", "--expect-serial", "S1", "--expect-mac", "0c:42:a1:00:11:23", "--hosted", "kubernetes"}, func(j *bcv1.JoinToken) bool {
				return j.MaxUses == 3 && j.AllowReclaim && j.GetExpect().GetSerial() == "S1" && j.GetExpect().GetMac() == "0c:42:a1:00:11:23" && j.Hosted == "kubernetes"
			}},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				pool := w.mkPool(t, "flags-"+c.name)
				var created bcv1.JoinToken
				w.cli(t, append([]string{"join-tokens", "create", "--tenant", w.root, "--pool", pool, "--json"}, c.args...)...).ok(t).decode(t, &created)
				if !c.check(&created) || created.PoolId != pool {
					t.Fatalf("create answered %v", &created)
				}
				listed := w.tokens(t, pool, false)
				if len(listed) != 1 || !c.check(listed[0]) {
					t.Fatalf("join-tokens list --json: %v", listed)
				}
				res, err := w.e.Admin.JoinTokens.ListJoinTokens(context.Background(), connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: pool}))
				if err != nil {
					t.Fatal(err)
				}
				if len(res.Msg.Items) != 1 || !c.check(res.Msg.Items[0]) {
					t.Fatalf("API list: %v", res.Msg.Items)
				}
			})
		}
		refused := []struct {
			name  string
			args  []string
			field string
		}{
			{"max-uses-0", []string{"--max-uses", "0"}, "--max-uses"},
			{"max-uses-negative", []string{"--max-uses", "-1"}, "--max-uses"},
			{"hosted-other", []string{"--hosted", "docker"}, "hosted"},
		}
		for _, c := range refused {
			t.Run(c.name, func(t *testing.T) {
				pool := w.mkPool(t, "refused-"+c.name)
				w.cli(t, append([]string{"join-tokens", "create", "--tenant", w.root, "--pool", pool}, c.args...)...).fails(t, "INVALID_ARGUMENT", c.field)
				if n := len(w.tokens(t, pool, true)); n != 0 {
					t.Fatalf("%d tokens minted", n)
				}
			})
		}
	})
}

// R3.3: list shows live tokens, --all adds revoked, expired and used-up ones,
// and no output ever holds a secret.
func TestJoinTokensList(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		var secrets []string
		mk := func(ttl string) string {
			var tok bcv1.JoinToken
			w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--ttl", ttl, "--json").ok(t).decode(t, &tok)
			_, secret, _ := strings.Cut(tok.Token, ".")
			if secret == "" {
				t.Fatalf("no token in %v", &tok)
			}
			secrets = append(secrets, tok.Token, secret)
			return tok.Id
		}
		live, short, revoked, usedUp := mk("1h"), mk("1m"), mk("1h"), mk("1h")
		w.cli(t, "join-tokens", "revoke", revoked, "--tenant", w.root, "--pool", w.pool).ok(t)
		// No machine joins here: spend the use as the join-token attestor does.
		if err := e.DB.WithTx(ctx, func(tx *store.Tx) error {
			_, err := tx.ConsumeJoinTokenUse(ctx, usedUp)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if err := e.DB.SetClockOffset(ctx, 61*time.Second); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.DB.SetClockOffset(ctx, 0) })

		noSecret := func(t *testing.T, r result) {
			t.Helper()
			for _, s := range secrets {
				if strings.Contains(r.stdout+r.stderr, s) {
					t.Fatalf("output holds a secret:\n%s", r.stdout)
				}
			}
			if strings.Contains(r.stdout, "bcjt_") {
				t.Fatalf("output holds a token:\n%s", r.stdout)
			}
		}
		cases := []struct {
			name string
			all  bool
			want map[string]string
		}{
			{"live only", false, map[string]string{live: "live"}},
			{"--all", true, map[string]string{live: "live", short: "expired", revoked: "revoked", usedUp: "used-up"}},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				args := []string{"join-tokens", "list", "--tenant", w.root, "--pool", w.pool}
				if c.all {
					args = append(args, "--all")
				}
				for _, format := range [][]string{{"--json"}, {"-o", "json"}} {
					r := w.cli(t, slices.Concat(args, format)...).ok(t)
					noSecret(t, r)
					if strings.Contains(r.stdout, `"token"`) {
						t.Fatalf("a listed token has a \"token\" key:\n%s", r.stdout)
					}
					var l bcv1.ListJoinTokensResponse
					r.decode(t, &l)
					got := map[string]string{}
					for _, it := range l.Items {
						got[it.Id] = it.State
						if it.Token != "" {
							t.Fatalf("%s listed with its token", it.Id)
						}
					}
					if len(got) != len(c.want) {
						t.Fatalf("%v: got %v, want %v", format, got, c.want)
					}
					for id, st := range c.want {
						if got[id] != st {
							t.Fatalf("%v: %s is %q, want %q", format, id, got[id], st)
						}
					}
				}
				r := w.cli(t, args...).ok(t)
				noSecret(t, r)
				lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
				if len(lines) != len(c.want)+1 || !strings.HasPrefix(lines[0], "ID ") {
					t.Fatalf("table:\n%s", r.stdout)
				}
				for id, st := range c.want {
					if !regexp.MustCompile(`(?m)^` + id + `\s+` + st + `\s`).MatchString(r.stdout) {
						t.Fatalf("table has no %s %s row:\n%s", id, st, r.stdout)
					}
				}
			})
		}
	})
}

// R3.3: list walks every page, beyond the API's 200 a page.
func TestJoinTokensListPaging(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		made := w.mkTokens(t, w.pool, 205, 3600)
		want := map[string]bool{}
		for _, m := range made {
			want[m.Id] = true
		}
		got := w.tokens(t, w.pool, false)
		if len(got) != 205 {
			t.Fatalf("list --json shows %d tokens, want 205", len(got))
		}
		for _, g := range got {
			if !want[g.Id] {
				t.Fatalf("unknown or repeated token %s", g.Id)
			}
			delete(want, g.Id)
		}
		r := w.cli(t, "join-tokens", "list", "--tenant", w.root, "--pool", w.pool).ok(t)
		if n := strings.Count(r.stdout, "\n"); n != 206 {
			t.Fatalf("table has %d lines, want 206", n)
		}
	})
}

// R3.3: revoke takes the id, twice is fine, and a pasted token is refused
// before anything is sent.
func TestJoinTokensRevoke(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		var tok bcv1.JoinToken
		w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &tok)

		t.Run("pasted token refused before sending", func(t *testing.T) {
			// Nothing listens on port 1: a request that went out would fail
			// with UNAVAILABLE.
			dead := map[string]string{"BETTER_COMPUTE_URL": "http://127.0.0.1:1", "BETTER_COMPUTE_API_KEY": e.AdminKey}
			run(t, dead, "join-tokens", "revoke", tok.Id, "--tenant", w.root, "--pool", w.pool).fails(t, "UNAVAILABLE")
			for _, arg := range []string{tok.Token, "bcjt_jt_x.secret", "jt_abc.def", ".", "x."} {
				run(t, dead, "join-tokens", "revoke", arg, "--tenant", w.root, "--pool", w.pool).fails(t, "INVALID_ARGUMENT", "TOKEN_ID", "nothing was sent")
				// Also refused without --tenant and --pool, and against the
				// real server, without touching the token.
				r := w.cli(t, "join-tokens", "revoke", arg)
				r.fails(t, "INVALID_ARGUMENT", "TOKEN_ID")
				if strings.Contains(r.stderr, "secret") && arg == tok.Token {
					_, secret, _ := strings.Cut(tok.Token, ".")
					if strings.Contains(r.stderr, secret) {
						t.Fatal("the error echoes the secret")
					}
				}
			}
			if l := w.tokens(t, w.pool, false); len(l) != 1 || l[0].State != "live" {
				t.Fatalf("tokens after refused revokes: %v", l)
			}
		})

		t.Run("by id, twice", func(t *testing.T) {
			for range 2 {
				var got bcv1.JoinToken
				w.cli(t, "join-tokens", "revoke", tok.Id, "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &got)
				if got.Id != tok.Id || got.State != "revoked" || got.RevokedAt == nil || got.Token != "" {
					t.Fatalf("revoke answered %v", &got)
				}
			}
			r := w.cli(t, "join-tokens", "revoke", tok.Id, "--tenant", w.root, "--pool", w.pool).ok(t)
			if !strings.Contains(r.stdout, tok.Id) || !strings.Contains(r.stdout, "revoked") {
				t.Fatalf("table:\n%s", r.stdout)
			}
			if l := w.tokens(t, w.pool, false); len(l) != 0 {
				t.Fatalf("live after revoke: %v", l)
			}
		})

		t.Run("unknown id and other tenant's pool", func(t *testing.T) {
			unknown := tok.Id[:len(tok.Id)-4] + "zzzz"
			w.cli(t, "join-tokens", "revoke", unknown, "--tenant", w.root, "--pool", w.pool).fails(t, "NOT_FOUND")
			w.cli(t, "join-tokens", "revoke", "jt_nosuchtoken", "--tenant", w.root, "--pool", w.pool).fails(t, "INVALID_ARGUMENT")
			run(t, w.as(w.acmeKey), "join-tokens", "revoke", tok.Id, "--tenant", w.acme, "--pool", w.pool).fails(t, "NOT_FOUND")
		})
	})
}

// R3.6: errors print "Error: CODE: message" on stderr and exit 1.
func TestErrors(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		acme := w.as(w.acmeKey)
		bad := w.as("bck_key_bogus.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
		noKey := map[string]string{"BETTER_COMPUTE_URL": e.URL}
		noURL := map[string]string{"BETTER_COMPUTE_API_KEY": e.AdminKey}
		cases := []struct {
			name string
			env  map[string]string
			args []string
			code string
			want []string
		}{
			{"another tenant's pool: create", acme, []string{"join-tokens", "create", "--tenant", w.acme, "--pool", w.pool}, "NOT_FOUND", nil},
			{"another tenant's pool: list", acme, []string{"join-tokens", "list", "--tenant", w.acme, "--pool", w.pool}, "NOT_FOUND", nil},
			{"another tenant's pool: get", acme, []string{"pools", "get", w.pool, "--tenant", w.acme}, "NOT_FOUND", nil},
			{"another tenant's pool via root tenant id", w.env, []string{"join-tokens", "create", "--tenant", w.root, "--pool", w.acmePool}, "NOT_FOUND", nil},
			{"bad key", bad, []string{"tenants", "list"}, "UNAUTHENTICATED", nil},
			{"bad key: create", bad, []string{"join-tokens", "create", "--tenant", w.root, "--pool", w.pool}, "UNAUTHENTICATED", nil},
			{"no key", noKey, []string{"tenants", "list"}, "UNAUTHENTICATED", []string{"BETTER_COMPUTE_API_KEY"}},
			{"no URL", noURL, []string{"tenants", "list"}, "INVALID_CONFIG", []string{"BETTER_COMPUTE_URL"}},
			{"--api-key overrides the environment", w.env, []string{"tenants", "list", "--api-key", "bck_key_bogus.x"}, "UNAUTHENTICATED", nil},
			{"missing --tenant: create", w.env, []string{"join-tokens", "create", "--pool", w.pool}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --pool: create", w.env, []string{"join-tokens", "create", "--tenant", w.root}, "INVALID_ARGUMENT", []string{"--pool"}},
			{"missing --tenant: list", w.env, []string{"join-tokens", "list", "--pool", w.pool}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: revoke", w.env, []string{"join-tokens", "revoke", "jt_x", "--pool", w.pool}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: sites", w.env, []string{"sites", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: pools", w.env, []string{"pools", "create", "p", "--site", w.site}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: api-keys", w.env, []string{"api-keys", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: nodes", w.env, []string{"nodes", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: events", w.env, []string{"events", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"missing --tenant: audit", w.env, []string{"audit", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"pool without daemon", w.env, nil, "INVALID_STATE", nil}, // args filled below
			{"unknown node", w.env, []string{"nodes", "get", "node_nosuch", "--tenant", w.root}, "NOT_FOUND", nil},
			{"bad --output", w.env, []string{"tenants", "list", "-o", "yaml"}, "INVALID_ARGUMENT", []string{"--output"}},
			{"bad --grant", w.env, []string{"api-keys", "create", "k", "--tenant", w.root, "--grant", "nonsense"}, "INVALID_ARGUMENT", []string{"--grant"}},
		}
		var np bcv1.Pool
		w.cli(t, "pools", "create", "bare", "--tenant", w.root, "--site", w.site, "--agent", "none", "--json").ok(t).decode(t, &np)
		for i := range cases {
			if cases[i].name == "pool without daemon" {
				cases[i].args = []string{"join-tokens", "create", "--tenant", w.root, "--pool", np.Id}
			}
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				run(t, c.env, c.args...).fails(t, c.code, c.want...)
			})
		}
		// Usage errors (cobra's own) still exit 1 with an Error: line.
		for _, args := range [][]string{{"join-tokens", "revoke"}, {"nosuchcommand"}, {"join-tokens", "create", "--nosuchflag"}} {
			r := w.cli(t, args...)
			if r.code != 1 || !strings.HasPrefix(r.stderr, "Error: ") {
				t.Fatalf("%v: exit %d, stderr %q", args, r.code, r.stderr)
			}
		}
	})
}

// R3.6: every operator command's --json output is JSON (events list: one
// object per line).
func TestJSONOutput(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		var tok bcv1.JoinToken
		w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &tok)
		var key bcv1.CreateApiKeyResponse
		w.cli(t, "api-keys", "create", "reader", "--tenant", w.root, "--grant", "compute:join-tokens:read=*", "--json").ok(t).decode(t, &key)
		dir := t.TempDir()
		cmds := [][]string{
			{"tenants", "create", "t2"},
			{"tenants", "list"},
			{"tenants", "get", w.root},
			{"sites", "create", "s2", "--tenant", w.root},
			{"sites", "list", "--tenant", w.root},
			{"sites", "get", w.site, "--tenant", w.root},
			{"pools", "create", "p2", "--tenant", w.root, "--site", w.site},
			{"pools", "list", "--tenant", w.root},
			{"pools", "get", w.pool, "--tenant", w.root},
			{"pools", "set-policy", w.pool, "--tenant", w.root, "--join-attestors", "join-token", "--min-memory", "1GiB"},
			{"api-keys", "create", "k2", "--tenant", w.root, "--grant", "*=*"},
			{"api-keys", "list", "--tenant", w.root},
			{"api-keys", "revoke", key.ApiKey.GetId(), "--tenant", w.root},
			{"join-tokens", "create", "--tenant", w.root, "--pool", w.pool},
			{"join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--out", filepath.Join(dir, "tok")},
			{"join-tokens", "list", "--tenant", w.root, "--pool", w.pool},
			{"join-tokens", "list", "--tenant", w.root, "--pool", w.pool, "--all"},
			{"join-tokens", "revoke", tok.Id, "--tenant", w.root, "--pool", w.pool},
			{"nodes", "list", "--tenant", w.root},
			{"events", "list", "--tenant", w.root},
			{"audit", "list", "--tenant", w.root},
			{"version"},
		}
		for _, args := range cmds {
			for _, flag := range [][]string{{"--json"}, {"-o", "json"}} {
				if len(args) > 1 && args[1] == "create" && flag[0] == "-o" {
					continue // once is enough for commands that write
				}
				t.Run(strings.Join(slices.Concat(args[:min(2, len(args))], flag), " "), func(t *testing.T) {
					r := w.cli(t, slices.Concat(args, flag)...).ok(t)
					if strings.TrimSpace(r.stdout) == "" {
						t.Fatal("no output")
					}
					dec := json.NewDecoder(strings.NewReader(r.stdout))
					for {
						var v any
						err := dec.Decode(&v)
						if err == io.EOF {
							break
						}
						if err != nil {
							t.Fatalf("not JSON: %v\n%s", err, r.stdout)
						}
						if _, ok := v.(map[string]any); !ok {
							t.Fatalf("want a JSON object, got %T:\n%s", v, r.stdout)
						}
					}
				})
			}
		}
	})
}

// R3.2, R3.6: the help of join-tokens create names its flags.
func TestJoinTokensCreateHelp(t *testing.T) {
	r := run(t, nil, "join-tokens", "create", "--help").ok(t)
	for _, f := range []string{"--tenant", "--pool", "--ttl", "--out", "--key", "--max-uses", "--allow-reclaim", "--hosted",
		"--expect-serial", "--expect-product-uuid", "--expect-mac", "--expect-gpu-uuid", "1m", "24h", "0600"} {
		if !strings.Contains(r.stdout, f) {
			t.Errorf("help does not mention %s", f)
		}
	}
	for _, args := range [][]string{{"join-tokens", "list", "--help"}, {"join-tokens", "revoke", "--help"}} {
		r := run(t, nil, args...).ok(t)
		if !strings.Contains(r.stdout, "--tenant") || !strings.Contains(r.stdout, "--pool") {
			t.Errorf("%v:\n%s", args, r.stdout)
		}
	}
	if r := run(t, nil, "join-tokens", "list", "--help"); !strings.Contains(r.stdout, "--all") {
		t.Errorf("list help has no --all")
	}
}

// R1, R3.6: tenants, sites, pools: create, list, get.
func TestResourcesSmoke(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)

		var tn bcv1.Tenant
		w.cli(t, "tenants", "create", "beta", "--json").ok(t).decode(t, &tn)
		if tn.Name != "beta" || !strings.HasPrefix(tn.Id, "tn_") || tn.Root {
			t.Fatalf("tenant %v", &tn)
		}
		var tl bcv1.ListTenantsResponse
		w.cli(t, "tenants", "list", "--json").ok(t).decode(t, &tl)
		if len(tl.Items) != 3 {
			t.Fatalf("tenants: %v", tl.Items)
		}
		if r := w.cli(t, "tenants", "list").ok(t); !strings.Contains(r.stdout, tn.Id) || !strings.Contains(r.stdout, "beta") {
			t.Fatalf("tenants table:\n%s", r.stdout)
		}
		if r := w.cli(t, "tenants", "get", tn.Id).ok(t); !strings.Contains(r.stdout, tn.Id) {
			t.Fatalf("tenants get:\n%s", r.stdout)
		}
		// Only the platform creates tenants.
		run(t, w.as(w.acmeKey), "tenants", "create", "evil").fails(t, "ACCESS_DENIED")

		var s bcv1.Site
		w.cli(t, "sites", "create", "us-1", "--tenant", w.root, "--region", "us", "--json").ok(t).decode(t, &s)
		if s.Name != "us-1" || s.Region != "us" || s.OwnerTenantId != w.root || s.Custom {
			t.Fatalf("site %v", &s)
		}
		var got bcv1.Site
		w.cli(t, "sites", "get", s.Id, "--tenant", w.root, "--json").ok(t).decode(t, &got)
		if !proto.Equal(&got, &s) {
			t.Fatalf("sites get %v, want %v", &got, &s)
		}
		if r := w.cli(t, "sites", "list", "--tenant", w.root).ok(t); !strings.Contains(r.stdout, s.Id) || !strings.Contains(r.stdout, w.site) {
			t.Fatalf("sites table:\n%s", r.stdout)
		}

		var p bcv1.Pool
		w.cli(t, "pools", "create", "cpu", "--tenant", w.root, "--site", s.Id, "--join-attestors", "join-token,tpm", "--min-cpus", "8", "--min-memory", "64GiB", "--json").ok(t).decode(t, &p)
		if p.Agent != "bcd" || p.SiteId != s.Id || strings.Join(p.GetPolicy().GetJoinAttestors(), ",") != "join-token,tpm" ||
			p.GetPolicy().GetAcceptance().GetMinCpus() != 8 || p.GetPolicy().GetAcceptance().GetMinMemoryBytes() != 64<<30 {
			t.Fatalf("pool %v", &p)
		}
		var pg bcv1.Pool
		w.cli(t, "pools", "get", p.Id, "--tenant", w.root, "--json").ok(t).decode(t, &pg)
		if pg.Id != p.Id || pg.Name != "cpu" {
			t.Fatalf("pools get %v", &pg)
		}
		var pl bcv1.ListPoolsResponse
		w.cli(t, "pools", "list", "--tenant", w.root, "--site", s.Id, "--json").ok(t).decode(t, &pl)
		if len(pl.Items) != 1 || pl.Items[0].Id != p.Id {
			t.Fatalf("pools list --site: %v", pl.Items)
		}
		if r := w.cli(t, "pools", "list", "--tenant", w.root).ok(t); !regexp.MustCompile(`(?m)^` + p.Id + `\s+cpu\s+` + s.Id + `\s+bcd\s+join-token,tpm\s+false\s+true\s*$`).MatchString(r.stdout) {
			t.Fatalf("pools table:\n%s", r.stdout)
		}
		// set-policy changes the flags given, and only
		// those; --clear-FLAG removes one; each step starts from the last.
		for _, step := range []struct {
			name      string
			args      []string
			attestors string
			acc       *bcv1.AcceptancePolicy // nil: no acceptance checks
			platform  bool
		}{
			{"one flag keeps the rest", []string{"--min-gpus", "8"}, "join-token,tpm", &bcv1.AcceptancePolicy{MinCpus: 8, MinMemoryBytes: 64 << 30, MinGpus: 8}, false},
			{"a set and a clear", []string{"--clear-min-memory", "--join-attestors", "tpm"}, "tpm", &bcv1.AcceptancePolicy{MinCpus: 8, MinGpus: 8}, false},
			{"a bool", []string{"--platform-operated"}, "tpm", &bcv1.AcceptancePolicy{MinCpus: 8, MinGpus: 8}, true},
			{"clear attestors", []string{"--clear-join-attestors"}, "", &bcv1.AcceptancePolicy{MinCpus: 8, MinGpus: 8}, true},
			{"clear the last minimums drops acceptance", []string{"--clear-min-cpus", "--clear-min-gpus", "--clear-platform-operated"}, "", nil, false},
			{"set again", []string{"--min-cpus", "2", "--min-memory", "1GiB"}, "", &bcv1.AcceptancePolicy{MinCpus: 2, MinMemoryBytes: 1 << 30}, false},
			{"clear acceptance", []string{"--clear-acceptance"}, "", nil, false},
		} {
			t.Run("set-policy "+step.name, func(t *testing.T) {
				var ps bcv1.Pool
				w.cli(t, slices.Concat([]string{"pools", "set-policy", p.Id, "--tenant", w.root, "--json"}, step.args)...).ok(t).decode(t, &ps)
				var stored bcv1.Pool
				w.cli(t, "pools", "get", p.Id, "--tenant", w.root, "--json").ok(t).decode(t, &stored)
				for _, got := range []*bcv1.Pool{&ps, &stored} {
					pol := got.GetPolicy()
					if strings.Join(pol.GetJoinAttestors(), ",") != step.attestors || !proto.Equal(pol.GetAcceptance(), step.acc) ||
						pol.GetKubernetes().GetPlatformOperated() != step.platform {
						t.Fatalf("policy %v, want attestors %q acceptance %v platformOperated %v", pol, step.attestors, step.acc, step.platform)
					}
				}
			})
		}
		for _, c := range []struct {
			args []string
			want string
		}{
			{nil, "nothing to change"},
			{[]string{"--min-cpus", "4", "--clear-min-cpus"}, "contradict"},
			{[]string{"--min-cpus", "4", "--clear-acceptance"}, "--clear-acceptance"},
			{[]string{"--join-attestors", "nope"}, "unknown attestor"},
		} {
			w.cli(t, slices.Concat([]string{"pools", "set-policy", p.Id, "--tenant", w.root}, c.args)...).fails(t, "INVALID_ARGUMENT", c.want)
		}
		w.cli(t, "pools", "create", "x", "--tenant", w.root, "--site", s.Id, "--min-memory", "lots").fails(t, "INVALID_ARGUMENT", "--min-memory")
	})
}

// R1.2: api-keys create prints the key once; list never shows it.
func TestAPIKeysSmoke(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		r := w.cli(t, "api-keys", "create", "ops", "--tenant", w.root, "--grant", "compute:join-tokens:*=compute-pool/"+w.pool).ok(t)
		m := regexp.MustCompile(`bck_key_[^\s]+`).FindAllString(r.stdout, -1)
		if len(m) != 1 || !strings.Contains(r.stdout, "shown once") {
			t.Fatalf("create output:\n%s", r.stdout)
		}
		key := m[0]
		_, secret, _ := strings.Cut(key, ".")
		var l bcv1.ListApiKeysResponse
		lr := w.cli(t, "api-keys", "list", "--tenant", w.root, "--json").ok(t)
		lr.decode(t, &l)
		var id string
		for _, k := range l.Items {
			if k.Name == "ops" {
				id = k.Id
			}
		}
		if id == "" {
			t.Fatalf("ops not listed: %v", l.Items)
		}
		tr := w.cli(t, "api-keys", "list", "--tenant", w.root).ok(t)
		for _, out := range []string{lr.stdout, tr.stdout} {
			if strings.Contains(out, key) || (secret != "" && strings.Contains(out, secret)) {
				t.Fatalf("list shows the key:\n%s", out)
			}
		}
		// The key works within its grant and nowhere else.
		ops := w.as(key)
		run(t, ops, "join-tokens", "list", "--tenant", w.root, "--pool", w.pool).ok(t)
		run(t, ops, "pools", "list", "--tenant", w.root).fails(t, "ACCESS_DENIED")

		run(t, w.env, "api-keys", "revoke", key, "--tenant", w.root).fails(t, "INVALID_ARGUMENT", "KEY_ID")
		w.cli(t, "api-keys", "revoke", id, "--tenant", w.root).ok(t)
		run(t, ops, "join-tokens", "list", "--tenant", w.root, "--pool", w.pool).fails(t, "UNAUTHENTICATED")
		if r := w.cli(t, "api-keys", "list", "--tenant", w.root).ok(t); !regexp.MustCompile(id + `\s+ops\s+revoked`).MatchString(r.stdout) {
			t.Fatalf("revoked key:\n%s", r.stdout)
		}
	})
}

// R3.6: nodes list and get (no machine joins here).
func TestNodesSmoke(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		var l bcv1.ListNodesResponse
		w.cli(t, "nodes", "list", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &l)
		if len(l.Items) != 0 {
			t.Fatalf("nodes: %v", l.Items)
		}
		if r := w.cli(t, "nodes", "list", "--tenant", w.root).ok(t); !strings.HasPrefix(r.stdout, "ID ") {
			t.Fatalf("nodes table:\n%s", r.stdout)
		}
		w.cli(t, "nodes", "get", "node_nosuch", "--tenant", w.root).fails(t, "NOT_FOUND")
	})
}

// R2.4, R14: creating a token shows in events and audit.
func TestEventsAndAuditSmoke(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		var tok bcv1.JoinToken
		w.cli(t, "join-tokens", "create", "--tenant", w.root, "--pool", w.pool, "--expect-serial", "S1", "--json").ok(t).decode(t, &tok)
		_, secret, _ := strings.Cut(tok.Token, ".")

		// Events become visible when their transaction's commit is ordered;
		// on PostgreSQL that may take a moment.
		var lines []string
		var out string
		poll.UntilDetail(t, 15*time.Second, func() string { return "a security.join-token.created event for " + tok.Id + ":\n" + out }, func() bool {
			r := w.cli(t, "events", "list", "--tenant", w.root, "--type", "security.join-token.", "--json").ok(t)
			out = r.stdout
			lines = strings.Split(strings.TrimSpace(r.stdout), "\n")
			return strings.Contains(r.stdout, tok.Id)
		})
		var found bool
		for _, l := range lines {
			var ev bcv1.Event
			if err := protojson.Unmarshal([]byte(l), &ev); err != nil {
				t.Fatalf("event line %q: %v", l, err)
			}
			if ev.Type == "security.join-token.created" && ev.Subject == tok.Id {
				found = true
				if pinned, _ := ev.Data.AsMap()["pinned"].(bool); !pinned {
					t.Fatalf("pinned not set: %v", ev.Data.AsMap())
				}
			}
			if strings.Contains(l, secret) {
				t.Fatal("an event holds the secret")
			}
		}
		if !found {
			t.Fatalf("no security.join-token.created with subject %s:\n%v", tok.Id, lines)
		}
		r := w.cli(t, "events", "list", "--tenant", w.root).ok(t)
		if !strings.Contains(r.stdout, "security.join-token.created") || !strings.HasPrefix(r.stderr, "cursor: ") {
			t.Fatalf("events table:\n%s\nstderr: %s", r.stdout, r.stderr)
		}
		// Resuming at the printed cursor shows nothing older.
		cursor := strings.TrimSpace(strings.TrimPrefix(r.stderr, "cursor: "))
		if r := w.cli(t, "events", "list", "--tenant", w.root, "--cursor", cursor, "--json").ok(t); strings.Contains(r.stdout, tok.Id) {
			t.Fatalf("events after the cursor:\n%s", r.stdout)
		}
		// R14.3: the cursor is sealed for its tenant: no number in it, and
		// another tenant's stream refuses it.
		if !strings.HasPrefix(cursor, "ev_") || strings.ContainsAny(cursor, ".") {
			t.Fatalf("printed cursor %q: want a sealed one", cursor)
		}
		w.cli(t, "events", "list", "--tenant", w.acme, "--cursor", cursor).fails(t, "INVALID_ARGUMENT", "cursor")

		// the table shows readable columns and a summary
		// of the data, not raw JSON.
		row := regexp.MustCompile(`(?m)^\S+Z\s+security\.join-token\.created\s+` + tok.Id + `\s+(.*)$`).FindStringSubmatch(r.stdout)
		if !strings.HasPrefix(r.stdout, "TIME ") || !strings.Contains(r.stdout, "SUMMARY") || row == nil {
			t.Fatalf("events table:\n%s", r.stdout)
		}
		// The subject is not repeated, false flags are left out, short
		// values come first.
		if sum := strings.TrimSpace(row[1]); !strings.HasPrefix(sum, "role=node ") || !strings.Contains(sum, " maxUses=1 pinned=true ") || strings.Contains(sum, "tokenId") ||
			strings.Contains(sum, "allowReclaim") || strings.ContainsAny(sum, "{\"") || len([]rune(sum)) > 80 {
			t.Fatalf("summary %q: want key=value pairs, at most 80 characters", sum)
		}

		// audit list reads oldest first with a cursor, one
		// JSON object per line like events.
		auditRows := func(args ...string) []*bcv1.AuditEntry {
			t.Helper()
			r := w.cli(t, slices.Concat([]string{"audit", "list", "--tenant", w.root, "--json"}, args)...).ok(t)
			var out []*bcv1.AuditEntry
			for _, l := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
				if l == "" {
					continue
				}
				var it bcv1.AuditEntry
				if err := protojson.Unmarshal([]byte(l), &it); err != nil {
					t.Fatalf("audit line %q: %v", l, err)
				}
				out = append(out, &it)
			}
			return out
		}
		all := auditRows()
		found = false
		for i, it := range all {
			if it.Action == "join-token.created" && it.Resource == "compute-pool/"+w.pool && it.Data.AsMap()["tokenId"] == tok.Id {
				found = true
			}
			if i > 0 && !(all[i-1].Time.AsTime().Compare(it.Time.AsTime()) <= 0) {
				t.Fatalf("audit rows not oldest first: %v then %v", all[i-1], it)
			}
		}
		if !found || len(all) < 3 {
			t.Fatalf("no join-token.created audit row for %s: %v", tok.Id, all)
		}
		// Paging with --limit 1 reads the same rows; the printed cursor
		// resumes after the last.
		paged := auditRows("--limit", "1")
		if len(paged) != len(all) {
			t.Fatalf("paged %d rows, bulk %d", len(paged), len(all))
		}
		ar := w.cli(t, "audit", "list", "--tenant", w.root).ok(t)
		if !strings.HasPrefix(ar.stdout, "TIME ") || !strings.Contains(ar.stdout, "join-token.created") || strings.Contains(ar.stdout, secret) ||
			!strings.HasPrefix(ar.stderr, "cursor: ") {
			t.Fatalf("audit table:\n%s\nstderr: %s", ar.stdout, ar.stderr)
		}
		end := strings.TrimSpace(strings.TrimPrefix(ar.stderr, "cursor: "))
		if end != all[len(all)-1].Cursor {
			t.Fatalf("printed cursor %q, last row's %q", end, all[len(all)-1].Cursor)
		}
		if rest := auditRows("--cursor", end); len(rest) != 0 {
			t.Fatalf("rows after the end cursor: %v", rest)
		}
		if rest := auditRows("--cursor", all[0].Cursor); len(rest) != len(all)-1 || rest[0].Id != all[1].Id {
			t.Fatalf("after the first row: %d rows", len(rest))
		}
		w.cli(t, "join-tokens", "revoke", tok.Id, "--tenant", w.root, "--pool", w.pool).ok(t)
		if rest := auditRows("--cursor", end); len(rest) != 1 || rest[0].Action != "join-token.revoked" {
			t.Fatalf("after the end cursor, once a token was revoked: %v", rest)
		}
		w.cli(t, "audit", "list", "--tenant", w.root, "--cursor", "nope").fails(t, "INVALID_ARGUMENT", "cursor")
	})
}

// R3.1: pki init, pins and issue-gateway.
func TestPKI(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "pki")
	// the secret comes from pki generate-secret; a weak
	// one is refused before anything is written.
	gen := run(t, nil, "pki", "generate-secret").ok(t).stdout
	if !regexp.MustCompile(`^[A-Za-z0-9_-]{43}\n$`).MatchString(gen) || gen == run(t, nil, "pki", "generate-secret").ok(t).stdout {
		t.Fatalf("generate-secret printed %q", gen)
	}
	env := map[string]string{"BETTER_COMPUTE_SECRET": strings.TrimSpace(gen)}
	noSecret := map[string]string{}

	run(t, noSecret, "pki", "init", "--trust-domain", "compute.example.com", "--dir", dir).fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET")
	run(t, map[string]string{"BETTER_COMPUTE_SECRET": "a"}, "pki", "init", "--trust-domain", "compute.example.com", "--dir", dir).
		fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET is too weak", "pki generate-secret")
	run(t, map[string]string{"BETTER_COMPUTE_SECRET": "correct horse battery staple"}, "pki", "init", "--trust-domain", "compute.example.com", "--dir", dir).
		fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET is too weak")
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Fatalf("init without a (strong) secret wrote %s: %v", dir, err)
	}
	run(t, env, "pki", "init", "--dir", dir).fails(t, "INVALID_ARGUMENT", "--trust-domain")

	var initOut struct {
		Dir         string            `json:"dir"`
		TrustDomain string            `json:"trustDomain"`
		Pins        map[string]string `json:"pins"`
	}
	r := run(t, env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", dir, "--json").ok(t)
	if err := json.Unmarshal([]byte(r.stdout), &initOut); err != nil {
		t.Fatalf("init --json: %v\n%s", err, r.stdout)
	}
	if initOut.Dir != dir || initOut.TrustDomain != "compute.example.com" || len(initOut.Pins) != 3 {
		t.Fatalf("init answered %+v", initOut)
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) == 0 {
		t.Fatalf("bundle dir: %v %v", entries, err)
	}
	for _, ent := range entries {
		if !strings.HasSuffix(ent.Name(), ".key") {
			continue
		}
		fi, _ := ent.Info()
		if fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s has mode %v", ent.Name(), fi.Mode().Perm())
		}
		data, _ := os.ReadFile(filepath.Join(dir, ent.Name()))
		if strings.Contains(string(data), "BEGIN EC PRIVATE KEY") || strings.Contains(string(data), "BEGIN PRIVATE KEY") {
			t.Errorf("%s is not encrypted", ent.Name())
		}
	}

	t.Run("init never overwrites", func(t *testing.T) {
		run(t, env, "pki", "init", "--trust-domain", "other.example.com", "--dir", dir).fails(t, "ALREADY_EXISTS")
	})

	t.Run("pins", func(t *testing.T) {
		var pins map[string]string
		r := run(t, env, "pki", "pins", "--dir", dir, "--json").ok(t)
		if err := json.Unmarshal([]byte(r.stdout), &pins); err != nil {
			t.Fatalf("pins --json: %v\n%s", err, r.stdout)
		}
		pin := regexp.MustCompile(`^sha256/[A-Za-z0-9+/_-]{43}=?$`)
		if len(pins) != 3 {
			t.Fatalf("pins: %v", pins)
		}
		for _, k := range []string{"servingCaPin", "joinSigningKeyPin", "joinEncryptionKeyPin"} {
			if !pin.MatchString(pins[k]) || pins[k] != initOut.Pins[k] {
				t.Fatalf("%s = %q (init said %q)", k, pins[k], initOut.Pins[k])
			}
		}
		// The table is a config.toml snippet with the same pins.
		tr := run(t, env, "pki", "pins", "--dir", dir).ok(t)
		if !strings.Contains(tr.stdout, `serving_ca_spki_pin = "`+pins["servingCaPin"]+`"`) {
			t.Fatalf("pins:\n%s", tr.stdout)
		}
		// The dir also comes from BETTER_COMPUTE_PKI_DIR.
		run(t, map[string]string{"BETTER_COMPUTE_PKI_DIR": dir}, "pki", "pins").ok(t)
		// pins are public; printing them needs no secret,
		// and a wrong one is never read.
		for name, e := range map[string]map[string]string{"no secret": noSecret, "wrong secret": {"BETTER_COMPUTE_SECRET": "wrong"}} {
			var got map[string]string
			if err := json.Unmarshal([]byte(run(t, e, "pki", "pins", "--dir", dir, "--json").ok(t).stdout), &got); err != nil || !maps.Equal(got, pins) {
				t.Fatalf("%s: pins %v (%v), want %v", name, got, err, pins)
			}
		}
		run(t, noSecret, "pki", "pins", "--dir", filepath.Join(base, "missing")).fails(t, "INVALID_CONFIG", "no PKI bundle")
	})

	t.Run("issue-gateway", func(t *testing.T) {
		out := t.TempDir()
		cert, key := filepath.Join(out, "gw.crt"), filepath.Join(out, "gw.key")
		args := []string{"pki", "issue-gateway", "--dir", dir, "--san", "gw.eu.example.com", "--cert-out", cert, "--key-out", key}
		run(t, env, "pki", "issue-gateway", "--dir", dir, "--cert-out", cert, "--key-out", key).fails(t, "INVALID_ARGUMENT", "--san")
		run(t, noSecret, args...).fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET")
		run(t, env, args...).ok(t)
		fi, err := os.Stat(key)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Fatalf("key mode %v, want 0600", fi.Mode().Perm())
		}
		if fi, err := os.Stat(cert); err != nil || fi.Mode().Perm()&0o022 != 0 {
			t.Fatalf("cert: %v %v", fi, err)
		}
		certPEM, _ := os.ReadFile(cert)
		keyPEM, _ := os.ReadFile(key)
		if !strings.Contains(string(certPEM), "BEGIN CERTIFICATE") || !strings.Contains(string(keyPEM), "PRIVATE KEY") {
			t.Fatalf("cert %q key %q", certPEM[:min(len(certPEM), 40)], keyPEM[:min(len(keyPEM), 40)])
		}
		var gw struct {
			CertFile, KeyFile string
			Sans              []string
		}
		c2, k2 := filepath.Join(out, "gw2.crt"), filepath.Join(out, "gw2.key")
		jr := run(t, env, "pki", "issue-gateway", "--dir", dir, "--san", "10.0.0.1", "--cert-out", c2, "--key-out", k2, "--json").ok(t)
		if err := json.Unmarshal([]byte(jr.stdout), &gw); err != nil || gw.CertFile != c2 || gw.KeyFile != k2 || len(gw.Sans) != 1 {
			t.Fatalf("issue-gateway --json: %v\n%s", err, jr.stdout)
		}
		// Existing files are never overwritten: either one.
		run(t, env, args...).fails(t, "ALREADY_EXISTS", cert)
		other := filepath.Join(out, "other.crt")
		run(t, env, "pki", "issue-gateway", "--dir", dir, "--san", "gw", "--cert-out", other, "--key-out", key).fails(t, "ALREADY_EXISTS", key)
		if _, err := os.Lstat(other); !os.IsNotExist(err) {
			t.Fatalf("%s written though the key exists", other)
		}
		if again, _ := os.ReadFile(key); !bytes.Equal(again, keyPEM) {
			t.Fatal("key changed")
		}
	})
}

// R3.6: cobra's own usage errors have the product's form too.
func TestUsageErrorsCoded(t *testing.T) {
	for _, args := range [][]string{{"join-tokens", "revoke"}, {"--bogus"}, {"frobnicate"}, {"pools", "list", "extra", "--bogus-flag"}} {
		run(t, map[string]string{}, args...).fails(t, "INVALID_ARGUMENT")
	}
}
