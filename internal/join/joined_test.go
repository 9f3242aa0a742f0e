package join

import (
	"encoding/json"
	"testing"
)

// TestJoinedDataEncodesAsTheMap: the node.joined event and audit data keep
// the bytes they had as a map (sorted keys), optional keys included or not.
func TestJoinedDataEncodesAsTheMap(t *testing.T) {
	for _, full := range []bool{false, true} {
		d := joinedData{NodeID: "node_1", PoolID: "pool_1", SiteID: "site_1", Role: "node", Attestor: "join-token", Reclaim: full,
			HardwareKeyTrusted: true, CertSerial: "0a0b", NodeKey: "unattested", IdentityGeneration: 3, JoinTokenID: "jt_1",
			Hostname: "h\"<1>", Peer: "192.0.2.1:5"}
		m := map[string]any{
			"nodeId": d.NodeID, "poolId": d.PoolID, "siteId": d.SiteID, "role": d.Role, "attestor": d.Attestor, "reclaim": d.Reclaim,
			"hardwareKeyTrusted": d.HardwareKeyTrusted, "certSerial": d.CertSerial, "nodeKey": d.NodeKey, "identityGeneration": d.IdentityGeneration,
			"joinTokenId": d.JoinTokenID, "hostname": d.Hostname, "peer": d.Peer,
		}
		if full {
			d.JoinRequestID, d.MadeAhead, d.Rejoin = "jreq_1", true, true
			m["joinRequestId"], m["madeAhead"], m["rejoin"] = d.JoinRequestID, true, true
		}
		got, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(m)
		if string(got) != string(want) {
			t.Errorf("joinedData encodes as\n%s\nthe map as\n%s", got, want)
		}
	}
}
