package doctest

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name, md, err string
		run           int // sh blocks run by walkthrough w
	}{
		{"run with output", "<!-- walkthrough: w -->\n```sh\necho hi\n```\n```\nhi\n```\n", "", 1},
		{"skipped with its output", "<!-- walkthrough: w -->\n<!-- skip: needs root -->\n```sh\nsystemctl start x\n```\n```\nok\n```\n", "", 0},
		{"sh outside a walkthrough", "```sh\nls\n```\n", "needs <!-- skip: reason -->", 0},
		{"skip without a reason", "<!-- skip: -->\n```sh\nls\n```\n", "needs a reason", 0},
		{"stray block in a walkthrough", "<!-- walkthrough: w -->\n```sh\nls\n```\ntext\n```\nout\n```\n", "neither run", 0},
		{"ended walkthrough", "<!-- walkthrough: w -->\n```sh\nls\n```\n<!-- walkthrough-end -->\n```toml\na=1\n```\n", "", 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			blocks, err := Parse("x.md", tc.md)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := len(Walkthrough(blocks, "w")); got != tc.run {
				t.Fatalf("%d blocks to run, want %d", got, tc.run)
			}
		})
	}
}

func TestCommands(t *testing.T) {
	got := Commands("a \\\n  --b # c\n\n# only a comment\nd 'x # y' &\n")
	want := []string{"a   --b", "d 'x # y' &"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("got %q, want %q", got, want)
	}
	if c, bg := Background(want[1]); !bg || c != "d 'x # y'" {
		t.Fatalf("Background: %q %v", c, bg)
	}
	if _, bg := Background("a && b"); bg {
		t.Fatal("&& is not a background command")
	}
	got = Commands("cat > f <<'TOML'\nlisten = \":443\"   # a comment of the file\n\nTOML\nnext\n")
	want = []string{"cat > f <<'TOML'\nlisten = \":443\"   # a comment of the file\n\nTOML", "next"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("a here-document: got %q, want %q", got, want)
	}
	// A here-string is one line.
	got = Commands("jq -r .a <<< hello\nnext\n")
	if want = []string{"jq -r .a <<< hello", "next"}; strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("a here-string: got %q, want %q", got, want)
	}
}

func TestMatch(t *testing.T) {
	n := Normaliser{Replace: []Replacement{{Old: "/tmp/walk", New: "$WORK"}}}
	tests := []struct {
		name, want, got string
		ok              bool
	}{
		{"ids times ports paths", "joined as node_01m8r3v434y5x6wty5axknvh7s at 2026-12-01T06:16:18Z via 127.0.0.1:8443 in /tmp/walk/x",
			"joined as node_01m8vmkfa02jdfd9hq66k5cmj3 at 2026-12-02T15:00:09.5Z via 127.0.0.1:40123 in /tmp/walk/x", true},
		{"columns", "ID    STATE\njt_01m8r3v2y0cb22sqq4nf35kgdw  live", "ID STATE\njt_01m8vmkcbh3yz9vs3p94x58xtg      live", true},
		{"ellipsis lines", "a\n…\nd", "a\nb\nc\nd", true},
		{"ellipsis in a line", "hardware key: 4857c677… trusted", "hardware key: 9ee889f8d4870e13 trusted", true},
		{"a changed word", "state: done", "state: failed", false},
		{"a line more than shown", "a", "a\nb", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if ok, diff := n.Match(tc.want, tc.got); ok != tc.ok {
				t.Fatalf("match %v, want %v\n%s", ok, tc.ok, diff)
			}
		})
	}
}

func TestSection(t *testing.T) {
	md := "# Ops\n## First install\n```sh\na\n```\n### Detail\n<!-- skip: root -->\n```sh\nb\n```\n```sh\n# c\n## not a heading\n```\n## Next\n```sh\nd\n```\n"
	blocks, err := ParseWalkthroughs("x.md", md)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		heading string
		want    []string
		ok      bool
	}{
		{"First install", []string{"a", "b", "# c\n## not a heading"}, true},
		{"Detail", []string{"b", "# c\n## not a heading"}, true},
		{"Next", []string{"d"}, true},
		{"Missing", nil, false},
	}
	for _, tc := range tests {
		got, ok := Section(md, blocks, tc.heading)
		var texts []string
		for _, b := range got {
			texts = append(texts, b.Text)
		}
		if ok != tc.ok || strings.Join(texts, "|") != strings.Join(tc.want, "|") {
			t.Errorf("Section(%q) = %q, %v; want %q, %v", tc.heading, texts, ok, tc.want, tc.ok)
		}
	}
}
