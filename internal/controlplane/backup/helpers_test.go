package backup_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// testSecret encrypts the test PKI's keys (a secret.GenerateStrong form).
var testSecret = []byte("lH3f2xq0m1U8cYt7bVQ2r9nK5sJwE6aZpD4gL0oTyXc")

// auth checks archives under testSecret.
var auth = backup.Auth{Secret: testSecret}

// plane is a control plane as serve runs it from a data directory: the
// SQLite file and the PKI directory on disk, the API on them, an admin
// client, and the agent listener a gateway relays joins to.
type plane struct {
	dir, dbPath, pkiDir string
	db                  *store.DB
	srv                 *api.Server
	bundle              *ca.Bundle
	admin               *client.Client
	root                string
	agent               agentv1connect.JoinServiceClient
}

// startPlane runs the API on dbPath and pkiDir, making the PKI when
// pkiDir holds none (pki init).
func startPlane(t testing.TB, dbPath, pkiDir string) *plane {
	t.Helper()
	ctx := context.Background()
	if _, err := os.Stat(filepath.Join(pkiDir, ca.FileManifest)); errors.Is(err, fs.ErrNotExist) {
		if _, err := ca.Init(pkiDir, "backup.test", testSecret, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	bundle, err := ca.Load(pkiDir, testSecret)
	if err != nil {
		t.Fatal(err)
	}
	db, err := store.Open(ctx, store.Config{Driver: "sqlite", Path: dbPath}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	srv, err := api.New(api.Config{DB: db, Bundle: bundle, Attestors: []string{wire.AttestorJoinToken, wire.AttestorX509Pop}})
	if err != nil {
		t.Fatal(err)
	}
	root, _, err := srv.Tenancy().Bootstrap(ctx, "root")
	if err != nil {
		t.Fatal(err)
	}
	var key string
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		_, key, err = authz.NewKey(ctx, tx, root.ID, fmt.Sprintf("admin-%d", now.UnixNano()), authz.Admin, 0, now)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	admin, err := client.New(client.Config{URL: hs.URL, APIKey: key})
	if err != nil {
		t.Fatal(err)
	}
	agentSrv := apitest.StartAgent(t, srv.AgentHandler(), bundle)
	agent := agentv1connect.NewJoinServiceClient(&http.Client{Transport: apitest.GatewayTransport(t, bundle)}, agentSrv.URL, connect.WithGRPC())
	return &plane{dir: filepath.Dir(dbPath), dbPath: dbPath, pkiDir: pkiDir, db: db, srv: srv, bundle: bundle, admin: admin, root: root.ID, agent: agent}
}

// newPlane starts a control plane in a new data directory.
func newPlane(t testing.TB) *plane {
	t.Helper()
	dir := t.TempDir()
	return startPlane(t, filepath.Join(dir, "bc.db"), filepath.Join(dir, "pki"))
}

// pool makes a site and a bcd pool in the root tenant.
func (p *plane) pool(t testing.TB) *bcv1.Pool {
	t.Helper()
	ctx := context.Background()
	s, err := p.admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: p.root, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	pl, err := p.admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: p.root, SiteId: s.Msg.Id, Name: "gpu", Agent: "bcd"}))
	if err != nil {
		t.Fatal(err)
	}
	return pl.Msg
}

// token mints a token of pool through the API.
func (p *plane) token(t testing.TB, pool string, uses int32, reclaim bool) *bcv1.JoinToken {
	t.Helper()
	tok, err := p.admin.JoinTokens.CreateJoinToken(context.Background(), connect.NewRequest(&bcv1.CreateJoinTokenRequest{
		TenantId: p.root, PoolId: pool, TtlSeconds: 3600, MaxUses: uses, AllowReclaim: reclaim}))
	if err != nil {
		t.Fatal(err)
	}
	return tok.Msg
}

func (p *plane) nodes(t testing.TB) []store.Node {
	t.Helper()
	var out []store.Node
	err := p.db.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
		out, err = tx.ListNodes(context.Background(), p.root, "", "", 100000)
		return
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (p *plane) tokenRow(t testing.TB, id string) store.JoinToken {
	t.Helper()
	var j store.JoinToken
	err := p.db.ReadTx(context.Background(), func(tx *store.Tx) (err error) { j, err = tx.GetJoinToken(context.Background(), id); return })
	if err != nil {
		t.Fatal(err)
	}
	return j
}

// restorePlane starts a control plane on a restored data directory.
func restorePlane(t testing.TB, dir string) *plane {
	t.Helper()
	return startPlane(t, filepath.Join(dir, "bc.db"), filepath.Join(dir, "pki"))
}

var joinPeer = join.Peer{Addr: "192.0.2.7:40000"}
