package api_test

import (
	"context"
	"testing"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// R19.1: an operator call that finds the database gone answers
// UNAVAILABLE with a message saying so (the caller retries, through
// another replica if need be), never INTERNAL. The store's own tests show
// the same for a full disk, a read-only database and a dropped connection.
func TestStoreGoneAnswersUnavailableR19_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		if err := e.DB.Close(); err != nil {
			t.Fatal(err)
		}
		_, err := e.Admin.JoinTokens.CreateJoinToken(context.Background(), rq(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600}))
		// The client turns the wire error back into the product's.
		errstest.Want(t, err, errs.Unavailable, "the database is unreachable; retry shortly")
	})
}
