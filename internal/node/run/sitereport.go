package run

import (
	"fmt"
	"log/slog"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/site"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// maxBootedPerReport bounds one report (the API refuses more than
// session.MaxBootedPerReport); the rest go in the next one.
const maxBootedPerReport = 500

// siteReports is a session's reporting of the booted file (R10.4): each
// report carries the machines that are new or changed since the session's
// last one, signed by the node key over the session's nonce, numbered from
// 1. A new session reports every machine again (the control plane keeps
// the newest lease epoch per MAC, so that changes nothing).
type siteReports struct {
	file string
	sent map[string]site.Machine
	seq  uint64
}

// next is the next report to send, nil when nothing changed.
func (r *siteReports) next(id *identity.Identity, nonce []byte, log *slog.Logger) (*agentv1.SiteReport, error) {
	machines, skipped, err := site.Read(r.file)
	if err != nil {
		log.Warn("read the booted file", telemetry.LogFile, r.file, telemetry.LogErr, err)
		return nil, nil
	}
	if skipped > 0 {
		log.Warn("booted file lines skipped", telemetry.LogFile, r.file, telemetry.LogLines, skipped)
	}
	var body agentv1.SiteReportBody
	for _, m := range machines {
		if r.sent[m.MAC] == m || len(body.Machines) == maxBootedPerReport {
			continue
		}
		body.Machines = append(body.Machines, &agentv1.BootedMachine{Mac: m.MAC, Ip: m.IP, LeaseEpoch: m.LeaseEpoch, WorkflowId: m.WorkflowID})
		r.sent[m.MAC] = m
	}
	if len(body.Machines) == 0 {
		return nil, nil
	}
	r.seq++
	body.Seq = r.seq
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(&body)
	if err != nil {
		return nil, fmt.Errorf("marshal a site report: %w", err)
	}
	sig, err := pki.SignSiteReport(id.Signer, nonce, raw)
	if err != nil {
		return nil, fmt.Errorf("sign a site report: %w", err)
	}
	log.Info("reporting booted machines", telemetry.LogMachines, len(body.Machines))
	return &agentv1.SiteReport{Body: raw, Sig: sig}, nil
}
