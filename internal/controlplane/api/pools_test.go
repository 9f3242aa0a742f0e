package api_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

func mask(paths ...string) *fieldmaskpb.FieldMask { return &fieldmaskpb.FieldMask{Paths: paths} }

// UpdatePoolPolicy with an update mask changes the named
// fields only (an unset value clears one); without a mask it replaces the
// policy. Masks are checked.
func TestUpdatePoolPolicyMask(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		update := func(pol *bcv1.PoolPolicy, m *fieldmaskpb.FieldMask) (*bcv1.PoolPolicy, error) {
			res, err := e.Admin.Pools.UpdatePoolPolicy(ctx, rq(&bcv1.UpdatePoolPolicyRequest{TenantId: w.root, PoolId: w.pool.Id, Policy: pol, UpdateMask: m}))
			if err != nil {
				return nil, err
			}
			return res.Msg.Policy, nil
		}
		full := &bcv1.PoolPolicy{JoinAttestors: []string{"join-token", "tpm"}, Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: true},
			Acceptance: &bcv1.AcceptancePolicy{MinCpus: 8, MinMemoryBytes: 1 << 30, MinGpus: 2}}
		steps := []struct {
			name string
			pol  *bcv1.PoolPolicy
			mask *fieldmaskpb.FieldMask
			want *bcv1.PoolPolicy
		}{
			{"no mask replaces", full, nil, full},
			{"one field", &bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinGpus: 4}}, mask("acceptance.min_gpus"),
				&bcv1.PoolPolicy{JoinAttestors: []string{"join-token", "tpm"}, Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: true},
					Acceptance: &bcv1.AcceptancePolicy{MinCpus: 8, MinMemoryBytes: 1 << 30, MinGpus: 4}}},
			{"an unset value clears", &bcv1.PoolPolicy{}, mask("join_attestors", "acceptance.min_memory_bytes", "kubernetes.platform_operated"),
				&bcv1.PoolPolicy{Kubernetes: &bcv1.KubernetesPolicy{}, Acceptance: &bcv1.AcceptancePolicy{MinCpus: 8, MinGpus: 4}}},
			{"the last minimum cleared drops acceptance", &bcv1.PoolPolicy{}, mask("acceptance.min_cpus", "acceptance.min_gpus"),
				&bcv1.PoolPolicy{Kubernetes: &bcv1.KubernetesPolicy{}}},
			{"a whole message", &bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinCpus: 1}}, mask("acceptance"),
				&bcv1.PoolPolicy{Kubernetes: &bcv1.KubernetesPolicy{}, Acceptance: &bcv1.AcceptancePolicy{MinCpus: 1}}},
		}
		for _, s := range steps {
			t.Run(s.name, func(t *testing.T) {
				got, err := update(s.pol, s.mask)
				mustOK(t, err)
				if s.want.Discovery == nil { // the default mode is shown
					s.want.Discovery = &bcv1.DiscoveryPolicy{Approval: tenancy.ApprovalUnknownMachines}
				}
				if !proto.Equal(got, s.want) {
					t.Fatalf("policy %v, want %v", got, s.want)
				}
			})
		}
		for _, c := range []struct {
			name string
			m    *fieldmaskpb.FieldMask
			pol  *bcv1.PoolPolicy
			fld  string
		}{
			{"unknown path", mask("acceptance.min_disks"), nil, "updateMask"},
			{"twice", mask("join_attestors", "join_attestors"), nil, "updateMask"},
			{"overlap", mask("acceptance", "acceptance.min_cpus"), nil, "updateMask"},
			{"invalid value", mask("join_attestors"), &bcv1.PoolPolicy{JoinAttestors: []string{"nope"}}, "policy.joinAttestors[0]"},
		} {
			t.Run(c.name, func(t *testing.T) {
				_, err := update(c.pol, c.m)
				wantErr(t, err, errs.InvalidArgument, c.fld)
			})
		}
	})
}

// concurrent changes of different fields all land (the
// merge reads the stored policy under a row lock in the transaction that
// writes it; a read-modify-write across calls would lose some).
func TestUpdatePoolPolicyConcurrentFields(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		for round := range 10 {
			_, err := e.Admin.Pools.UpdatePoolPolicy(ctx, rq(&bcv1.UpdatePoolPolicyRequest{TenantId: w.root, PoolId: w.pool.Id, Policy: &bcv1.PoolPolicy{}}))
			mustOK(t, err)
			n := int32(round + 1)
			writes := []struct {
				pol  *bcv1.PoolPolicy
				path string
			}{
				{&bcv1.PoolPolicy{JoinAttestors: []string{"tpm"}}, "join_attestors"},
				{&bcv1.PoolPolicy{Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: true}}, "kubernetes.platform_operated"},
				{&bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinCpus: n}}, "acceptance.min_cpus"},
				{&bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinGpus: n}}, "acceptance.min_gpus"},
				{&bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinMemoryBytes: int64(n)}}, "acceptance.min_memory_bytes"},
			}
			var wg sync.WaitGroup
			errc := make(chan error, len(writes))
			for _, wr := range writes {
				wg.Go(func() {
					_, err := e.Admin.Pools.UpdatePoolPolicy(ctx, rq(&bcv1.UpdatePoolPolicyRequest{TenantId: w.root, PoolId: w.pool.Id, Policy: wr.pol, UpdateMask: mask(wr.path)}))
					errc <- err
				})
			}
			wg.Wait()
			close(errc)
			for err := range errc {
				mustOK(t, err)
			}
			got, err := e.Admin.Pools.GetPool(ctx, rq(&bcv1.GetPoolRequest{TenantId: w.root, PoolId: w.pool.Id}))
			mustOK(t, err)
			pol := got.Msg.Policy
			want := &bcv1.PoolPolicy{JoinAttestors: []string{"tpm"}, Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: true},
				Acceptance: &bcv1.AcceptancePolicy{MinCpus: n, MinGpus: n, MinMemoryBytes: int64(n)},
				Discovery:  &bcv1.DiscoveryPolicy{Approval: tenancy.ApprovalUnknownMachines}}
			if !proto.Equal(pol, want) || !slices.Equal(pol.JoinAttestors, want.JoinAttestors) {
				t.Fatalf("round %d: policy %v, want %v (a concurrent change was lost)", round, pol, want)
			}
		}
	})
}
