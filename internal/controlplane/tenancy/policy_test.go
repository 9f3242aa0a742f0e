package tenancy_test

import (
	"fmt"
	"reflect"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// R1.1, R6.4, R10.4: a pool policy names known attestors once each, a known
// approval mode, and no negative acceptance minimum.
func TestPolicyValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy tenancy.Policy
		field  string
		msg    string
	}{
		{"empty", tenancy.Policy{}, "", ""},
		{"every attestor", tenancy.Policy{JoinAttestors: []string{"join-token", "tpm", "discovery", "x509pop"}}, "", ""},
		{"unknown attestor", tenancy.Policy{JoinAttestors: []string{"join-token", "psk"}}, "policy.joinAttestors[1]",
			fmt.Sprintf(`policy.joinAttestors[1]: unknown attestor "psk" (want one of %v)`, tenancy.Attestors)},
		{"attestor twice", tenancy.Policy{JoinAttestors: []string{"tpm", "tpm"}}, "policy.joinAttestors[1]", `policy.joinAttestors[1]: "tpm" listed twice`},
		{"approval always", tenancy.Policy{Discovery: tenancy.Discovery{Approval: tenancy.ApprovalAlways}}, "", ""},
		{"approval never", tenancy.Policy{Discovery: tenancy.Discovery{Approval: tenancy.ApprovalNever}}, "", ""},
		{"approval unknown-machines", tenancy.Policy{Discovery: tenancy.Discovery{Approval: tenancy.ApprovalUnknownMachines}}, "", ""},
		{"approval unknown", tenancy.Policy{Discovery: tenancy.Discovery{Approval: "sometimes"}}, "policy.discovery.approval",
			`policy.discovery.approval: unknown approval mode "sometimes" (want unknown-machines, always or never)`},
		{"acceptance", tenancy.Policy{Acceptance: &tenancy.Acceptance{MinCPUs: 8, MinMemoryBytes: 1 << 30, MinGPUs: 1}}, "", ""},
		{"negative acceptance", tenancy.Policy{Acceptance: &tenancy.Acceptance{MinGPUs: -1}}, "policy.acceptance",
			"policy.acceptance: minimums cannot be negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.policy.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			errstest.Want(t, err, errs.InvalidArgument, tc.msg)
			if e, _ := errs.As(err); e.Field != tc.field {
				t.Fatalf("field = %q, want %q", e.Field, tc.field)
			}
		})
	}
}

// R6.4: an empty joinAttestors allows every attestor; a list allows only
// those named. R10.4: the approval mode defaults to unknown-machines.
func TestPolicyDecisions(t *testing.T) {
	all := tenancy.Policy{}
	tpmOnly := tenancy.Policy{JoinAttestors: []string{"tpm"}}
	for _, a := range tenancy.Attestors {
		if !all.AllowsAttestor(a) {
			t.Errorf("an empty list must allow %s", a)
		}
		if got := tpmOnly.AllowsAttestor(a); got != (a == "tpm") {
			t.Errorf("tpm only: AllowsAttestor(%s) = %v", a, got)
		}
	}
	for approval, want := range map[string]string{
		"":                              tenancy.ApprovalUnknownMachines,
		tenancy.ApprovalUnknownMachines: tenancy.ApprovalUnknownMachines,
		tenancy.ApprovalAlways:          tenancy.ApprovalAlways,
		tenancy.ApprovalNever:           tenancy.ApprovalNever,
	} {
		if got := (tenancy.Policy{Discovery: tenancy.Discovery{Approval: approval}}).ApprovalMode(); got != want {
			t.Errorf("ApprovalMode(%q) = %q, want %q", approval, got, want)
		}
	}
}

// R1.1: a stored policy decodes to what was stored; no policy is the empty
// one; a corrupt one is an error, not an empty policy that allows all.
func TestParsePolicy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		raw     string
		want    tenancy.Policy
		wantErr bool
	}{
		{"none", "", tenancy.Policy{}, false},
		{"empty object", "{}", tenancy.Policy{}, false},
		{"full", `{"joinAttestors":["tpm","x509pop"],"kubernetes":{"platformOperated":true},"acceptance":{"minGpus":2},"discovery":{"approval":"never"}}`,
			tenancy.Policy{JoinAttestors: []string{"tpm", "x509pop"}, Kubernetes: tenancy.Kubernetes{PlatformOperated: true},
				Acceptance: &tenancy.Acceptance{MinGPUs: 2}, Discovery: tenancy.Discovery{Approval: "never"}}, false},
		{"corrupt", `{"joinAttestors":"tpm"}`, tenancy.Policy{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tenancy.ParsePolicy([]byte(tc.raw))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if !tc.wantErr && !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// R2.2, R11.3: join tokens and nodes made ahead are only for pools whose
// machines run the daemon.
func TestRunsDaemon(t *testing.T) {
	if err := tenancy.RunsDaemon(store.Pool{ID: "pool_1", Agent: "bcd"}, "join tokens"); err != nil {
		t.Fatal(err)
	}
	errstest.Want(t, tenancy.RunsDaemon(store.Pool{ID: "pool_1", Agent: "ipmi"}, "join tokens"), errs.InvalidState,
		`pool pool_1 runs no daemon (agent "ipmi"): join tokens are only for pools with agent "bcd"`)
}
